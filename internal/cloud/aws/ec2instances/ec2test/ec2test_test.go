package ec2test_test

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/smithy-go"

	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
)

func client(srv *ec2test.Server, attempts int) *ec2.Client {
	return ec2.NewFromConfig(aws.Config{
		Region:      srv.Region,
		Credentials: credentials.NewStaticCredentialsProvider("AKIAIOSFODNN7EXAMPLE", "secret", ""),
		Retryer: func() aws.Retryer {
			return retry.NewStandard(func(o *retry.StandardOptions) { o.MaxAttempts = attempts; o.MaxBackoff = 1 })
		},
	}, ec2instances.GuardBodies, func(o *ec2.Options) { o.BaseEndpoint = aws.String(srv.URL) })
}

func filter(name string, values ...string) types.Filter {
	return types.Filter{Name: aws.String(name), Values: values}
}

func ids(out *ec2.DescribeInstancesOutput) []string {
	var s []string
	for _, r := range out.Reservations {
		for _, i := range r.Instances {
			s = append(s, aws.ToString(i.InstanceId))
		}
	}
	return s
}

func fixture(t *testing.T) *ec2test.Server {
	srv := ec2test.New(t)
	srv.Put(
		ec2test.Instance{
			ID: "i-00000000000000001", VPCID: "vpc-0000000000000000a", PrivateDNSName: "a.internal",
			Interfaces: [][]netip.Addr{{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")}, {netip.MustParseAddr("10.0.1.1")}},
			Tags:       map[string]string{"aws:autoscaling:groupName": "workers", "Name": "a*b"},
		},
		ec2test.Instance{
			ID: "i-00000000000000002", VPCID: "vpc-0000000000000000b", State: "stopped",
			Interfaces: [][]netip.Addr{{netip.MustParseAddr("10.0.0.3")}},
		},
	)
	return srv
}

// TestFilters checks the filters against the semantics the EC2 API reference gives them.
func TestFilters(t *testing.T) {
	srv := fixture(t)
	api := client(srv, 1)
	for _, tc := range []struct {
		name    string
		filters []types.Filter
		want    string
	}{
		{"primary address", []types.Filter{filter("private-ip-address", "10.0.0.1")}, "i-00000000000000001"},
		{"primary address of the second interface", []types.Filter{filter("private-ip-address", "10.0.1.1")}, "i-00000000000000001"},
		// private-ip-address matches only an interface's primary address.
		{"secondary address, private-ip-address", []types.Filter{filter("private-ip-address", "10.0.0.2")}, ""},
		{"secondary address", []types.Filter{filter("network-interface.addresses.private-ip-address", "10.0.0.2")}, "i-00000000000000001"},
		{"values are ORed", []types.Filter{filter("network-interface.addresses.private-ip-address", "10.9.9.9", "10.0.0.3")}, "i-00000000000000002"},
		{"filters are ANDed", []types.Filter{filter("network-interface.addresses.private-ip-address", "10.0.0.1", "10.0.0.3"), filter("instance-state-name", "running")}, "i-00000000000000001"},
		{"state", []types.Filter{filter("instance-state-name", "stopped")}, "i-00000000000000002"},
		{"vpc", []types.Filter{filter("vpc-id", "vpc-0000000000000000a")}, "i-00000000000000001"},
		{"tag", []types.Filter{filter("tag:aws:autoscaling:groupName", "workers")}, "i-00000000000000001"},
		{"tag wildcard", []types.Filter{filter("tag:Name", "a*")}, "i-00000000000000001"},
		{"tag escaped wildcard", []types.Filter{filter("tag:Name", `a\*b`)}, "i-00000000000000001"},
		{"tag escaped wildcard, no match", []types.Filter{filter("tag:Name", `a\*`)}, ""},
		{"tag-key", []types.Filter{filter("tag-key", "Name")}, "i-00000000000000001"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := api.DescribeInstances(t.Context(), &ec2.DescribeInstancesInput{Filters: tc.filters})
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(ids(out), ","); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestErrors(t *testing.T) {
	srv := fixture(t)
	api := client(srv, 1)
	many := make([]string, ec2test.MaxFilterValues+1)
	for i := range many {
		many[i] = fmt.Sprintf("10.2.%d.%d", i/250, i%250)
	}
	for _, tc := range []struct {
		name string
		in   *ec2.DescribeInstancesInput
		code string
	}{
		{"unknown filter", &ec2.DescribeInstancesInput{Filters: []types.Filter{filter("no-such-filter", "x")}}, "InvalidParameterValue"},
		{"too many values", &ec2.DescribeInstancesInput{Filters: []types.Filter{filter("private-ip-address", many...)}}, "InvalidParameterValue"},
		{"MaxResults too small", &ec2.DescribeInstancesInput{MaxResults: aws.Int32(4)}, "InvalidParameterValue"},
		{"MaxResults with ids", &ec2.DescribeInstancesInput{MaxResults: aws.Int32(5), InstanceIds: []string{"i-00000000000000001"}}, "InvalidParameterValue"},
		{"unknown id", &ec2.DescribeInstancesInput{InstanceIds: []string{"i-0000000000000000f"}}, "InvalidInstanceID.NotFound"},
		{"bad token", &ec2.DescribeInstancesInput{NextToken: aws.String("nope")}, "InvalidParameterValue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := api.DescribeInstances(t.Context(), tc.in)
			var ae smithy.APIError
			if !errors.As(err, &ae) || ae.ErrorCode() != tc.code {
				t.Errorf("error %v, want code %s", err, tc.code)
			}
		})
	}

	// Throttling is EC2's: RequestLimitExceeded with 503, which the SDK's retryer recognises.
	srv.ThrottleNext(2)
	if _, err := client(srv, 3).DescribeInstances(t.Context(), &ec2.DescribeInstancesInput{}); err != nil {
		t.Errorf("after two throttled attempts: %v", err)
	}
	srv.ThrottleNext(1)
	_, err := api.DescribeInstances(t.Context(), &ec2.DescribeInstancesInput{})
	var re *smithy.GenericAPIError
	if !errors.As(err, &re) || re.Code != "RequestLimitExceeded" || !strings.Contains(err.Error(), "StatusCode: 503") {
		t.Errorf("throttled: %v", err)
	}
}

func TestPaginator(t *testing.T) {
	srv := ec2test.New(t)
	for i := range 12 {
		srv.Put(ec2test.Instance{ID: fmt.Sprintf("i-%017x", i+1), VPCID: "vpc-0000000000000000a",
			Interfaces: [][]netip.Addr{{netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)})}}})
	}
	p := ec2.NewDescribeInstancesPaginator(client(srv, 1), &ec2.DescribeInstancesInput{
		Filters: []types.Filter{filter("vpc-id", "vpc-0000000000000000a")}, MaxResults: aws.Int32(5),
	})
	var all []string
	pages := 0
	for p.HasMorePages() {
		out, err := p.NextPage(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		pages++
		all = append(all, ids(out)...)
	}
	if pages != 3 || len(all) != 12 {
		t.Errorf("%d pages, %d instances; want 3 and 12", pages, len(all))
	}
}

// TestTLS serves https on an address of the caller's choosing, with a certificate for that address that
// the endpoint's own CA signed; the SDK trusts it by that CA alone, and the endpoint tells who signed.
func TestTLS(t *testing.T) {
	srv := ec2test.NewWithOptions(t, ec2test.Options{Addr: "127.0.0.1:0", TLS: true})
	if !strings.HasPrefix(srv.URL, "https://127.0.0.1:") {
		t.Fatalf("URL %s, want https on 127.0.0.1", srv.URL)
	}
	srv.Put(ec2test.Instance{ID: "i-00000000000000001", Interfaces: [][]netip.Addr{{netip.MustParseAddr("10.0.0.1")}}})
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(srv.CACertPEM) {
		t.Fatalf("CACertPEM holds no certificate: %q", srv.CACertPEM)
	}
	call := func(roots *x509.CertPool) error {
		api := ec2.NewFromConfig(aws.Config{
			Region:      srv.Region,
			Credentials: credentials.NewStaticCredentialsProvider("AKIAIOSFODNN7EXAMPLE", "secret", ""),
			HTTPClient:  &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}},
			Retryer:     func() aws.Retryer { return aws.NopRetryer{} },
		}, ec2instances.GuardBodies, func(o *ec2.Options) { o.BaseEndpoint = aws.String(srv.URL) })
		out, err := api.DescribeInstances(t.Context(), &ec2.DescribeInstancesInput{})
		if err == nil && strings.Join(ids(out), ",") != "i-00000000000000001" {
			t.Errorf("got %v", ids(out))
		}
		return err
	}
	if err := call(pool); err != nil {
		t.Fatal(err)
	}
	if err := call(x509.NewCertPool()); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("a client that does not trust the endpoint's CA: %v, want a certificate error", err)
	}
	if got := srv.AccessKeyIDs(); len(got) != 1 || got[0] != "AKIAIOSFODNN7EXAMPLE" {
		t.Errorf("AccessKeyIDs() = %v", got)
	}
}

// TestZones: the SDK reads an instance's zone and the region's zones, with their ids, as the AWS cloud
// controller manager's node controller does.
func TestZones(t *testing.T) {
	srv := fixture(t)
	srv.Put(ec2test.Instance{ID: "i-00000000000000003", Zone: "us-east-1c", Interfaces: [][]netip.Addr{{netip.MustParseAddr("10.0.2.1")}}})
	api := client(srv, 1)
	out, err := api.DescribeInstances(t.Context(), &ec2.DescribeInstancesInput{InstanceIds: []string{"i-00000000000000001", "i-00000000000000003"}})
	if err != nil {
		t.Fatal(err)
	}
	var zones []string
	for _, r := range out.Reservations {
		for _, i := range r.Instances {
			zones = append(zones, aws.ToString(i.Placement.AvailabilityZone))
		}
	}
	if got := strings.Join(zones, ","); got != "us-east-1a,us-east-1c" {
		t.Errorf("zones %q, want us-east-1a (the default) and us-east-1c", got)
	}

	azs, err := api.DescribeAvailabilityZones(t.Context(), &ec2.DescribeAvailabilityZonesInput{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, z := range azs.AvailabilityZones {
		got = append(got, fmt.Sprintf("%s=%s %s %s %s", aws.ToString(z.ZoneName), aws.ToString(z.ZoneId), aws.ToString(z.RegionName), z.State, aws.ToString(z.ZoneType)))
	}
	if want := "us-east-1a=use1-az4 us-east-1 available availability-zone;us-east-1b=use1-az6 us-east-1 available availability-zone;us-east-1c=use1-az1 us-east-1 available availability-zone"; strings.Join(got, ";") != want {
		t.Errorf("zones %q, want %q", strings.Join(got, ";"), want)
	}
	topo, err := api.DescribeInstanceTopology(t.Context(), &ec2.DescribeInstanceTopologyInput{InstanceIds: []string{"i-00000000000000003"}})
	switch {
	case err != nil:
		t.Errorf("DescribeInstanceTopology: %v", err)
	case len(topo.Instances) != 0:
		t.Errorf("DescribeInstanceTopology of an m7i.large: %v, want no topology, as EC2 answers for types it has none for", topo.Instances)
	}
	if _, err := api.DescribeAvailabilityZones(t.Context(), &ec2.DescribeAvailabilityZonesInput{ZoneNames: []string{"us-east-1z"}}); err == nil ||
		!strings.Contains(err.Error(), "The zone 'us-east-1z' does not exist") {
		t.Errorf("an unknown zone: %v", err)
	}
}

package imds

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/test/imdstest"
)

// These tests run the client against amazon-ec2-metadata-mock, AWS's IMDS emulator, with IMDSv2 required.

func TestSelfFromAWSMock(t *testing.T) {
	ud := testUserData
	ud.Role = metadata.RoleControlPlane
	mock := imdstest.Start(t, imdstest.Config{
		InstanceID:       "i-0fedcba9876543210",
		LocalHostname:    "ip-10-0-2-7.eu-west-1.compute.internal",
		LocalIPv4:        "10.0.2.7",
		AMIID:            "ami-0123456789abcdef0",
		UserData:         userDataJSON(t, ud),
		AvailabilityZone: "eu-west-1c",
	})
	ctx := context.Background()

	// IMDSv2 is enforced: without a token, or with one the mock never issued, nothing is served.
	for _, token := range []string{"", "AQAEAnot-issued=="} {
		if code := getStatus(t, mock.URL+"/latest/meta-data/instance-id", token); code != http.StatusUnauthorized {
			t.Fatalf("GET instance-id with token %q: %d, want 401: the mock does not require IMDSv2 tokens\n%s", token, code, mock.Log())
		}
	}

	before := mock.TokensIssued()
	c := &Client{Endpoint: mock.URL}
	self, err := c.Self(ctx)
	if err != nil {
		t.Fatalf("Self: %v\n%s", err, mock.Log())
	}
	want := &metadata.Self{
		Instance: metadata.Instance{
			Name:      "ip-10-0-2-7.eu-west-1.compute.internal",
			Role:      metadata.RoleControlPlane,
			Addresses: []netip.Addr{netip.MustParseAddr("10.0.2.7")},
			ImageID:   "ami-0123456789abcdef0",
			ID:        "i-0fedcba9876543210",
		},
		UserData:   ud,
		ProviderID: "aws:///eu-west-1c/i-0fedcba9876543210",
	}
	if diff := cmp.Diff(want, self, equateAddr); diff != "" {
		t.Fatalf("Self (-want +got):\n%s", diff)
	}
	if _, err := c.Self(ctx); err != nil {
		t.Fatalf("second Self: %v", err)
	}
	// The mock's own placement and network values, which this test leaves as they are.
	region, vpc, err := c.Placement(ctx)
	if err != nil || region != "us-east-1" || vpc != "vpc-d295a6a7" {
		t.Fatalf("Placement = %q, %q, %v; want the mock's us-east-1, vpc-d295a6a7\n%s", region, vpc, err, mock.Log())
	}
	if got := mock.TokensIssued() - before; got != 1 {
		t.Fatalf("the client asked the mock for %d tokens in three reads, want 1 reused", got)
	}

	// A token the mock does not know (as after an IMDS restart) is refused with 401, and replaced once.
	c.mu.Lock()
	c.token = "AQAEAforgotten=="
	c.mu.Unlock()
	if _, err := c.Self(ctx); err != nil {
		t.Fatalf("Self with a token the mock does not know: %v\n%s", err, mock.Log())
	}
	if got := mock.TokensIssued() - before; got != 2 {
		t.Fatalf("the client asked the mock for %d tokens, want 2: one new one after the 401", got)
	}
}

func TestUserDataErrorsFromAWSMock(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config imdstest.Config
		want   error
	}{
		// The mock's own default user-data, "1234,john,reboot,true", is no berth_node_config.
		{"mock's default user-data", imdstest.Config{}, ErrBadUserData},
		{"no user-data", imdstest.Config{NoUserData: true}, ErrNoUserData},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mock := imdstest.Start(t, tc.config)
			_, err := (&Client{Endpoint: mock.URL}).Self(context.Background())
			if !errors.Is(err, tc.want) {
				t.Fatalf("Self: %v, want %v\n%s", err, tc.want, mock.Log())
			}
		})
	}
}

// getStatus is a plain GET, with token as the IMDSv2 header when not empty.
func getStatus(t *testing.T, url, token string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("X-aws-ec2-metadata-token", token)
	}
	resp, err := defaultHTTPClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

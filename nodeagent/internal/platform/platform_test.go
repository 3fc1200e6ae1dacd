package platform_test

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/nodeagent/internal/platform"
	"github.com/berthlabs/berth/nodeagent/internal/platform/aws"
	"github.com/berthlabs/berth/nodeagent/internal/platform/baremetal"
	"github.com/berthlabs/berth/nodeagent/internal/platform/gcp"
	"github.com/berthlabs/berth/nodeagent/internal/platform/lab"
)

// Every environment is a Platform.
var (
	_ platform.Platform = (*lab.Platform)(nil)
	_ platform.Platform = (*baremetal.Platform)(nil)
	_ platform.Platform = (*aws.Platform)(nil)
	_ platform.Platform = (*gcp.Platform)(nil)
)

// TestRecordsRefusals: a platform that cannot tell who a connecting node is says why before its join service
// listens, and asks no cloud API on the way.
func TestRecordsRefusals(t *testing.T) {
	self := &metadata.Self{}
	var env platform.Env
	for _, c := range []struct {
		p    platform.Platform
		want string
	}{
		{baremetal.New("/etc/berth/user-data.json", netip.Addr{}), "serves no joins"},
		{aws.New(aws.Config{IMDSEndpoint: "http://127.0.0.1:1"}), "no autoscaling group may join"},
		{gcp.New(gcp.Config{MetadataEndpoint: "http://127.0.0.1:1"}), "no managed instance group may join"},
		{lab.New("http://127.0.0.1:1", netip.Addr{}, filepath.Join(t.TempDir(), "missing.pem")), "EK CA bundle"},
	} {
		_, err := c.p.Records(context.Background(), self, env)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error containing %q", c.p.Name(), err, c.want)
		}
	}
}

func TestReadCABundleRefusesGarbage(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ek.pem")
	if err := os.WriteFile(path, []byte("not PEM"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := platform.EKVerifier(path); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("EKVerifier of garbage: %v, want an error naming %s", err, path)
	}
}

func TestCheckEndpoints(t *testing.T) {
	errs := platform.CheckEndpoints("aws", map[string]string{"a": "ftp://x", "b": "", "c": "https://ec2.eu-west-1.amazonaws.com", "d": "127.0.0.1:80"})
	var got []string
	for _, err := range errs {
		got = append(got, err.Error())
	}
	want := []string{`aws.a "ftp://x" is not an http(s) URL`, `aws.d "127.0.0.1:80" is not an http(s) URL`}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

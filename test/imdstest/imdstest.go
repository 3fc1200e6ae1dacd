// Package imdstest runs amazon-ec2-metadata-mock, AWS's own emulator of the EC2 instance metadata service,
// on loopback for tests, built by scripts/build-imds-mock.sh at the version pinned in test/awstools, so
// that the IMDSv2 client is tested against AWS's idea of IMDS (its token handshake, its answers) and not
// only against a fake of the test's own making. Every mock requires IMDSv2 tokens, as a Berth launch
// template does, and serves the instance values and user-data the test gives it.
package imdstest

import (
	"encoding/base64"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berthlabs/berth/internal/repotest"
)

// Config is what the mock serves; empty values are the mock's defaults.
type Config struct {
	InstanceID    string // meta-data/instance-id
	LocalHostname string // meta-data/local-hostname (and meta-data/hostname)
	LocalIPv4     string // meta-data/local-ipv4
	AMIID         string // meta-data/ami-id
	// Region is meta-data/placement/region, and VPCID the vpc-id of the instance's primary network
	// interface (meta-data/network/interfaces/macs/<meta-data/mac>/vpc-id).
	Region, VPCID string
	// AvailabilityZone is meta-data/placement/availability-zone.
	AvailabilityZone string
	// Credentials, if set, are the instance profile's (meta-data/iam/security-credentials/<role>), which
	// the AWS SDK's default credential chain takes on an instance; the mock's defaults expired in 2020.
	Credentials *Credentials
	// UserData is user-data; nil leaves the mock's default ("1234,john,reboot,true").
	UserData []byte
	// NoUserData serves no user-data at all (404), as an instance launched without it.
	NoUserData bool
}

// Credentials are an instance profile's temporary credentials.
type Credentials struct {
	AccessKeyID, SecretAccessKey, Token string
	Expiration                          time.Time
}

// The mock's keys (its config file's metadata.values) for the primary interface's VPC, of its default MAC.
const (
	keyVPCID       = "mac-vpc-id"
	keyRegion      = "placement-region"
	keyZone        = "placement-availability-zone"
	keyCredentials = "iam-security-credentials"
)

// MockConfig is cfg as the mock's configuration file (--config-file), for callers that run the mock
// themselves (a lab, inside a node's network namespace).
func MockConfig(cfg Config) ([]byte, error) {
	values := map[string]any{}
	for key, v := range map[string]string{
		"instance-id": cfg.InstanceID, "local-hostname": cfg.LocalHostname, "hostname": cfg.LocalHostname,
		"local-ipv4": cfg.LocalIPv4, "ami-id": cfg.AMIID, keyRegion: cfg.Region, keyVPCID: cfg.VPCID,
		keyZone: cfg.AvailabilityZone,
	} {
		if v != "" {
			values[key] = v
		}
	}
	if c := cfg.Credentials; c != nil {
		values[keyCredentials] = map[string]string{
			"Code": "Success", "LastUpdated": time.Now().UTC().Format(time.RFC3339), "Type": "AWS-HMAC",
			"AccessKeyId": c.AccessKeyID, "SecretAccessKey": c.SecretAccessKey, "Token": c.Token,
			"Expiration": c.Expiration.UTC().Format(time.RFC3339),
		}
	}
	config := map[string]any{"metadata": map[string]any{"values": values}}
	switch {
	case cfg.NoUserData:
		// The mock serves a path only when it has both a path and a value for it.
		config["userdata"] = map[string]any{"paths": map[string]string{"userdata": ""}}
	case cfg.UserData != nil:
		// The mock holds user-data base64-encoded, as EC2's API takes it, and serves it decoded.
		config["userdata"] = map[string]any{"values": map[string]string{"userdata": base64.StdEncoding.EncodeToString(cfg.UserData)}}
	}
	return json.Marshal(config)
}

// Args are the mock's arguments to serve configFile on hostname:port with IMDSv2 required. Run it with
// HOME set to a directory of its own and no AEMM_* variables: it reads both as configuration.
func Args(hostname string, port int, configFile string) []string {
	return []string{"--hostname", hostname, "--port", strconv.Itoa(port), "--imdsv2", "--config-file", configFile}
}

// Server is a running ec2-metadata-mock on 127.0.0.1.
type Server struct {
	URL string // http://127.0.0.1:<port>, the client's Endpoint

	log     *lockedBuffer
	process *os.Process
	exited  chan struct{}
	stop    sync.Once
}

// Start runs the mock with IMDSv2 required and cfg's values; it is stopped when the test ends.
func Start(t testing.TB, cfg Config) *Server {
	t.Helper()
	bin := Binary(t)
	dir := t.TempDir()

	data, err := MockConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	configFile := filepath.Join(dir, "aemm-config.json")
	if err := os.WriteFile(configFile, data, 0o600); err != nil {
		t.Fatal(err)
	}

	// The mock takes a port, not a listener: reserve a free one and release it just before.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()

	s := &Server{URL: "http://127.0.0.1:" + strconv.Itoa(port), log: &lockedBuffer{}, exited: make(chan struct{})}
	cmd := exec.Command(bin, Args("127.0.0.1", port, configFile)...)
	// The mock reads AEMM_* variables as configuration and $HOME/aemm-config.json: neither of the
	// developer's may change what a test serves.
	cmd.Env = []string{"HOME=" + dir, "PATH=" + os.Getenv("PATH")}
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = s.log, s.log
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting ec2-metadata-mock: %v", err)
	}
	s.process = cmd.Process
	go func() {
		_ = cmd.Wait()
		close(s.exited)
	}()
	t.Cleanup(s.Stop)
	s.waitReady(t)
	return s
}

// waitReady waits until the mock issues a token; a mock that exits or never answers fails the test.
func (s *Server) waitReady(t testing.TB) {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{}, Timeout: time.Second}
	defer client.CloseIdleConnections()
	deadline := time.Now().Add(20 * time.Second)
	for {
		req, err := http.NewRequest(http.MethodPut, s.URL+"/latest/api/token", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-aws-ec2-metadata-token-ttl-seconds", "60")
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-s.exited:
			t.Fatalf("ec2-metadata-mock exited before it was ready:\n%s", s.log)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("ec2-metadata-mock did not issue a token on %s within 20s:\n%s", s.URL, s.log)
		}
	}
}

// Stop kills the mock and waits until it has exited; stopping again does nothing.
func (s *Server) Stop() {
	s.stop.Do(func() {
		_ = s.process.Kill()
		<-s.exited
	})
}

// TokensIssued counts the session tokens the mock has been asked for, from its log (one line per PUT to
// /latest/api/token), the readiness check's included.
func (s *Server) TokensIssued() int {
	return strings.Count(s.log.String(), "GenerateToken Received request")
}

// Log is what the mock has logged so far, for failure messages.
func (s *Server) Log() string { return s.log.String() }

// Binary returns the ec2-metadata-mock binary of $BERTH_IMDS_MOCK_BIN (a bin directory) or else of
// scripts/build-imds-mock.sh, which builds it on first use.
func Binary(t testing.TB) string {
	t.Helper()
	dir := repotest.BinDir(t, "BERTH_IMDS_MOCK_BIN", "build-imds-mock.sh", "it needs go and the Go module proxy or cache")
	bin := filepath.Join(dir, "ec2-metadata-mock")
	if fi, err := os.Stat(bin); err != nil || fi.Mode()&0o111 == 0 {
		t.Fatalf("ec2-metadata-mock not found as an executable at %s (BERTH_IMDS_MOCK_BIN=%q): run scripts/build-imds-mock.sh", bin, os.Getenv("BERTH_IMDS_MOCK_BIN"))
	}
	return bin
}

// lockedBuffer is the mock's output, written by exec's copying goroutine and read by the test.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

package ec2instances

import (
	"maps"
	"net/netip"
	"sync"
	"testing"

	"github.com/berthlabs/berth/internal/cloud/apicalls"
	"github.com/berthlabs/berth/internal/cloud/aws/ec2instances/ec2test"
)

// outcomes counts what an apicalls.Counter is told.
type outcomes struct {
	mu sync.Mutex
	n  map[apicalls.Outcome]int
}

func (o *outcomes) Count(out apicalls.Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[apicalls.Outcome]int{}
	}
	o.n[out]++
}

// TestCallsCounted: every attempt the SDK makes is counted, the ones it retried after throttling included,
// and a refusal (an IAM denial) is an error; the count matches what EC2 received.
func TestCallsCounted(t *testing.T) {
	srv := ec2test.New(t)
	srv.Put(node(1, workGroup, addrs("10.0.2.10")), node(2, cpGroup, addrs("10.0.1.10")))
	counted := &outcomes{}
	l := newLookup(t, srv, func(c *Config) { c.Calls = counted })
	srv.ThrottleNext(3)
	if _, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.2.10")); err != nil {
		t.Fatalf("lookup after 3 throttled attempts: %v", err)
	}
	srv.Deny(ec2test.DescribeInstances)
	if _, err := l.InstanceByAddress(t.Context(), netip.MustParseAddr("10.0.1.10")); err == nil {
		t.Fatal("lookup succeeded though DescribeInstances is denied")
	}
	want := map[apicalls.Outcome]int{apicalls.Throttled: 3, apicalls.OK: 1, apicalls.Error: 1}
	if !maps.Equal(counted.n, want) {
		t.Errorf("attempts counted %v, want %v", counted.n, want)
	}
	if calls := srv.Calls(ec2test.DescribeInstances); calls != 5 {
		t.Errorf("EC2 received %d DescribeInstances calls, the counter 5", calls)
	}
}

// Package apifault is what the stand-ins of cloud APIs (ec2test, computetest) can be told to do wrong, the
// same way for each: throttle a share of requests at random, deny an operation as a missing IAM permission
// would, hold every request until released. Each stand-in answers in its own API's shapes; this package only
// decides.
package apifault

import (
	"math/rand/v2"
	"sync"
)

// Knobs are a stand-in's faults. The zero value injects none. They are safe for concurrent use.
type Knobs struct {
	mu       sync.Mutex
	fraction float64
	deny     map[string]bool
	hold     chan struct{}
	arrived  chan string
}

// ThrottleFraction throttles about that fraction of requests, at random; 0 stops it.
func (k *Knobs) ThrottleFraction(f float64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.fraction = f
}

// Deny refuses every request of op (an EC2 action, a Compute method) as one the caller may not make.
func (k *Knobs) Deny(op string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.deny == nil {
		k.deny = map[string]bool{}
	}
	k.deny[op] = true
}

// Hold makes every request wait until Release. Each request sends its op on the returned channel once it
// has been counted, before it waits.
func (k *Knobs) Hold() <-chan string {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.hold == nil {
		k.hold = make(chan struct{})
		k.arrived = make(chan string, 1024)
	}
	return k.arrived
}

// Release lets held requests go on; later ones are no longer held.
func (k *Knobs) Release() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.hold != nil {
		close(k.hold)
		k.hold = nil
	}
}

// Arrived decides about a request of op that has arrived: throttled says it drew a throttle, denied that
// op is denied; wait returns once the request may go on (at once unless the knobs hold requests, after
// reporting op on Hold's channel).
func (k *Knobs) Arrived(op string) (throttled, denied bool, wait func()) {
	k.mu.Lock()
	defer k.mu.Unlock()
	throttled = k.fraction > 0 && rand.Float64() < k.fraction
	denied = k.deny[op]
	hold, arrived := k.hold, k.arrived
	wait = func() {
		if hold != nil {
			arrived <- op
			<-hold
		}
	}
	return throttled, denied, wait
}

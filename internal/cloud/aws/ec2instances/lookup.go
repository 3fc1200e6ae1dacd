// Package ec2instances is the join service's view of a node on Amazon EC2: the instance record of a
// connecting address, and the endorsement key of an instance's NitroTPM, both from EC2's own API.
//
// Trust model. The join service trusts EC2's API, which it reaches with its own credentials (the instance
// profile of the control-plane nodes) over TLS to AWS's endpoint. Nothing read here can be written by a
// node: a node cannot change its private addresses, its VPC, its image or its instance id, and the one tag
// that gives a role, aws:autoscaling:groupName, is set by EC2 Auto Scaling alone (tag keys starting with
// "aws:" are reserved to AWS; no principal in the account can create, change or delete them). Every other
// tag is ignored, since anyone allowed ec2:CreateTags, or a node whose instance profile lets it tag itself,
// could set it. The EK comes from GetInstanceTpmEkPub, which reports the key of the NitroTPM AWS attached to
// that instance: a node proves it holds that TPM by credential activation, elsewhere. What remains trusted
// is the account's IAM: whoever may create or change the listed autoscaling groups, or launch instances
// into them, decides which instances get a role.
//
// Cost. The join service already puts an instancecache in front of every lookup (a few seconds of memory,
// one call per address at a time, "not found" remembered too). Behind it, this package merges the lookups
// of different addresses that arrive close together into one DescribeInstances call with many values of
// one filter, so a join storm of a thousand nodes costs a handful of calls instead of a thousand, and paces
// its calls below EC2's request-token refill rate; an instance's EK never changes in its life, so it is
// cached for minutes.
package ec2instances

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"golang.org/x/time/rate"

	"github.com/berthlabs/berth/internal/cloud/apicalls"
	"github.com/berthlabs/berth/internal/metadata"
)

// API is the part of EC2's API this package calls; *ec2.Client satisfies it.
type API interface {
	DescribeInstances(ctx context.Context, in *ec2.DescribeInstancesInput, optFns ...func(*ec2.Options)) (*ec2.DescribeInstancesOutput, error)
	GetInstanceTpmEkPub(ctx context.Context, in *ec2.GetInstanceTpmEkPubInput, optFns ...func(*ec2.Options)) (*ec2.GetInstanceTpmEkPubOutput, error)
}

var _ API = (*ec2.Client)(nil)

// GroupTag is the tag EC2 Auto Scaling puts on the instances it launches, naming their group. Only AWS can
// set a tag whose key starts with "aws:".
const GroupTag = "aws:autoscaling:groupName"

// Defaults and limits of Config.
const (
	// DefaultBatchWindow is how long the first lookup of a batch waits for others to join it: far below a
	// join's duration (a TPM quote alone takes longer), and long enough that a storm's lookups share calls.
	DefaultBatchWindow = 50 * time.Millisecond
	// MaxBatchSize is EC2's limit of values in one filter (assumed: EC2 answers InvalidParameterValue "The
	// maximum number of filter values specified on a single call is 200" above it).
	MaxBatchSize = 200
	// DefaultPageSize is the most instances DescribeInstances returns per page (its MaxResults is 5 to 1000):
	// a batch of at most MaxBatchSize addresses matches at most that many instances, so one page.
	DefaultPageSize = 1000
	// DefaultCallTimeout bounds one batch (all its pages and retries) or one EK request, below the join
	// service's 30 s exchange timeout.
	DefaultCallTimeout = 20 * time.Second
	// DefaultEKCacheTTL is how long an EK is remembered. An instance's EK never changes while it lives and
	// instance ids are never reused, so the TTL only bounds memory held for terminated instances.
	DefaultEKCacheTTL = 10 * time.Minute
	// DefaultEKCacheSize bounds the EK cache; more nodes than this joining within the TTL only cost calls.
	DefaultEKCacheSize = 4096
	// DefaultDescribeRate, DefaultEKRate and DefaultBurst pace the calls of each action. EC2 throttles per
	// account, region and action with token buckets (documented for non-mutating actions: 100 tokens,
	// refilled at 20 a second). DescribeInstances is shared with every other tool of the account (the cloud
	// controller manager, autoscalers, Terraform), and batching makes few calls carry many lookups, so the
	// join service takes a quarter of its refill rate. GetInstanceTpmEkPub is used by little else and cannot
	// be batched: it gets half.
	DefaultDescribeRate rate.Limit = 5
	DefaultEKRate       rate.Limit = 10
	DefaultBurst                   = 10
)

// Config configures a Lookup; API, VPCID and Roles are required, every other field has a default.
type Config struct {
	API API
	// VPCID is the VPC of the cluster's nodes; instances elsewhere are never found.
	VPCID string
	// Roles maps autoscaling group names to the role of their instances. An instance in no group, or in a
	// group not listed, has no record.
	Roles  map[string]metadata.Role
	Logger *slog.Logger
	// Calls, if set, counts every request to EC2 by outcome, each of the SDK's retries included; it works
	// with an API from NewAPI (the count rides on the SDK's middleware) and counts nothing of another.
	Calls apicalls.Counter
	// Clock is the time EK cache entries expire by (time.Now if nil).
	Clock func() time.Time

	// BatchWindow is how long a batch stays open for more addresses after its first.
	BatchWindow time.Duration
	// BatchSize is the most addresses in one DescribeInstances call (at most MaxBatchSize); a batch that
	// reaches it is sent at once.
	BatchSize int
	// PageSize is DescribeInstances' MaxResults, 5 to 1000.
	PageSize int32
	// CallTimeout bounds one batch or one EK request, retries included.
	CallTimeout time.Duration
	// EKCacheTTL and EKCacheSize bound the EK cache.
	EKCacheTTL  time.Duration
	EKCacheSize int
	// DescribeRate and EKRate pace DescribeInstances pages and GetInstanceTpmEkPub requests, each action with
	// its own Burst (the SDK's retries of one call are its own). rate.Inf turns pacing off. A call whose
	// turn would come after CallTimeout fails at once.
	DescribeRate rate.Limit
	EKRate       rate.Limit
	Burst        int
}

// Lookup finds EC2 instances by private address and reports their NitroTPM's EK. It is safe for concurrent
// use, and implements the join service's InstanceLookup and attest.EKPublicSource.
type Lookup struct {
	cfg        Config
	log        *slog.Logger
	groups     string // the configured group names, for errors
	describeRL *rate.Limiter
	*EKs

	mu    sync.Mutex
	open  *batch // the batch still taking addresses, if any
	timer *time.Timer
}

var vpcIDPattern = regexp.MustCompile(`^vpc-[0-9a-f]{8}([0-9a-f]{9})?$`)

// New checks cfg and fills in its defaults.
func New(cfg Config) (*Lookup, error) {
	if cfg.API == nil {
		return nil, errors.New("ec2instances: API is required")
	}
	if !vpcIDPattern.MatchString(cfg.VPCID) {
		return nil, fmt.Errorf("ec2instances: VPC id %q is not vpc- and 8 or 17 lowercase hex digits", bounded(cfg.VPCID))
	}
	if len(cfg.Roles) == 0 {
		return nil, errors.New("ec2instances: no autoscaling group has a role: every instance would be refused")
	}
	names := make([]string, 0, len(cfg.Roles))
	for group, role := range cfg.Roles {
		// EC2 Auto Scaling group names are 1 to 255 characters, no control characters.
		if group == "" || len(group) > 255 || strings.ContainsFunc(group, isControl) {
			return nil, fmt.Errorf("ec2instances: autoscaling group name %q is empty, longer than 255 bytes or contains control characters", bounded(group))
		}
		if !role.Valid() {
			return nil, fmt.Errorf("ec2instances: autoscaling group %q: role %q is not %q or %q", group, bounded(string(role)), metadata.RoleControlPlane, metadata.RoleWorker)
		}
		names = append(names, group)
	}
	slices.Sort(names)

	for _, d := range []struct {
		name string
		v    time.Duration
		def  time.Duration
		set  func(time.Duration)
	}{
		{"batch window", cfg.BatchWindow, DefaultBatchWindow, func(v time.Duration) { cfg.BatchWindow = v }},
		{"call timeout", cfg.CallTimeout, DefaultCallTimeout, func(v time.Duration) { cfg.CallTimeout = v }},
		{"EK cache TTL", cfg.EKCacheTTL, DefaultEKCacheTTL, func(v time.Duration) { cfg.EKCacheTTL = v }},
	} {
		switch {
		case d.v < 0:
			return nil, fmt.Errorf("ec2instances: %s %v is negative", d.name, d.v)
		case d.v == 0:
			d.set(d.def)
		}
	}
	switch {
	case cfg.BatchSize < 0 || cfg.BatchSize > MaxBatchSize:
		return nil, fmt.Errorf("ec2instances: batch size %d is not between 1 and EC2's limit of %d values per filter", cfg.BatchSize, MaxBatchSize)
	case cfg.BatchSize == 0:
		cfg.BatchSize = MaxBatchSize
	}
	switch {
	case cfg.PageSize == 0:
		cfg.PageSize = DefaultPageSize
	case cfg.PageSize < 5 || cfg.PageSize > 1000:
		return nil, fmt.Errorf("ec2instances: page size %d is not between 5 and 1000 (DescribeInstances' MaxResults)", cfg.PageSize)
	}
	switch {
	case cfg.EKCacheSize < 0:
		return nil, fmt.Errorf("ec2instances: EK cache size %d is negative", cfg.EKCacheSize)
	case cfg.EKCacheSize == 0:
		cfg.EKCacheSize = DefaultEKCacheSize
	}
	if cfg.DescribeRate < 0 || cfg.EKRate < 0 || cfg.Burst < 0 {
		return nil, fmt.Errorf("ec2instances: rates %v, %v or burst %d is negative", cfg.DescribeRate, cfg.EKRate, cfg.Burst)
	}
	if cfg.DescribeRate == 0 {
		cfg.DescribeRate = DefaultDescribeRate
	}
	if cfg.EKRate == 0 {
		cfg.EKRate = DefaultEKRate
	}
	if cfg.Burst == 0 {
		cfg.Burst = DefaultBurst
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// A copy, so that a caller changing its map later cannot change roles behind the checks above.
	cfg.Roles = maps.Clone(cfg.Roles)
	if cfg.Calls != nil {
		cfg.API = countedAPI{API: cfg.API, count: countAttempts(cfg.Calls)}
	}
	log = log.With("subsystem", "ec2instances", "vpc", cfg.VPCID)
	return &Lookup{
		cfg:        cfg,
		log:        log,
		groups:     strings.Join(names, ", "),
		describeRL: rate.NewLimiter(cfg.DescribeRate, cfg.Burst),
		EKs:        newEKs(cfg.API, log, cfg.Clock, cfg.EKCacheTTL, cfg.EKCacheSize, cfg.CallTimeout, cfg.EKRate, cfg.Burst),
	}, nil
}

// batch is the lookups of one DescribeInstances call. results and err are written before done is closed
// and only read after.
type batch struct {
	addrs   []netip.Addr
	seen    map[netip.Addr]struct{}
	done    chan struct{}
	results map[netip.Addr]answer
	err     error
}

type answer struct {
	inst *metadata.Instance
	err  error
}

// InstanceByAddress returns the record of the running instance in the VPC that has addr as the primary
// private IPv4 address of one of its network interfaces. A secondary address is no node's: the VPC CNI
// gives those to pods, which must not pass the join service's admission as their node (and take its
// connections). Lookups of different addresses arriving together share one DescribeInstances call. An
// address no running instance of the VPC has, or whose instance has no role, gives an error wrapping
// metadata.ErrNotFound; failures to ask EC2 give other errors.
func (l *Lookup) InstanceByAddress(ctx context.Context, addr netip.Addr) (*metadata.Instance, error) {
	addr = addr.Unmap()
	if !addr.Is4() {
		// EC2's private-address filters know IPv4 only; nodes join over their private IPv4 address.
		return nil, fmt.Errorf("%w: %s is not an IPv4 address; EC2 instances are looked up by private IPv4 address", metadata.ErrNotFound, addr)
	}
	if err := context.Cause(ctx); err != nil {
		return nil, fmt.Errorf("looking up %s on EC2: %w", addr, err)
	}
	b := l.enqueue(addr)
	select {
	case <-b.done:
	case <-ctx.Done():
		// The batch goes on for the others in it.
		return nil, fmt.Errorf("looking up %s on EC2: %w", addr, context.Cause(ctx))
	}
	if b.err != nil {
		return nil, fmt.Errorf("looking up %s on EC2: %w", addr, b.err)
	}
	a := b.results[addr]
	if a.err != nil {
		return nil, a.err
	}
	return copyOf(a.inst), nil
}

// enqueue adds addr to the open batch, opening one if none is, and sends the batch once it is full.
func (l *Lookup) enqueue(addr netip.Addr) *batch {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open == nil {
		b := &batch{seen: map[netip.Addr]struct{}{}, done: make(chan struct{})}
		l.open = b
		l.timer = time.AfterFunc(l.cfg.BatchWindow, func() { l.send(b) })
	}
	b := l.open
	if _, ok := b.seen[addr]; !ok {
		b.seen[addr] = struct{}{}
		b.addrs = append(b.addrs, addr)
	}
	if len(b.addrs) >= l.cfg.BatchSize {
		l.open = nil // full: it takes no more addresses
		if l.timer.Stop() {
			go l.send(b)
		}
		// Otherwise the window has ended and send is already waiting for b's turn.
	}
	return b
}

// send waits for b's turn to call DescribeInstances, then calls. Until then b keeps taking addresses (unless
// full): when calls are scarce, batches grow instead of queueing. A turn later than CallTimeout is not
// waited for; the call then fails at once, and so does every lookup of b.
func (l *Lookup) send(b *batch) {
	r := l.describeRL.Reserve()
	held := r.OK() && r.Delay() <= l.cfg.CallTimeout
	if held {
		time.Sleep(r.Delay())
	} else {
		r.Cancel()
	}
	l.mu.Lock()
	if l.open == b {
		l.open = nil
	}
	l.mu.Unlock()
	l.run(b, held)
}

// run asks EC2 about every address of b and answers each. It runs on its own context: a lookup whose
// caller gives up must not fail the others of its batch.
func (l *Lookup) run(b *batch, held bool) {
	defer close(b.done)
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.CallTimeout)
	defer cancel()
	start := time.Now()
	instances, pages, err := l.describe(ctx, b.addrs, held)
	if err != nil {
		b.err = err
		l.log.Warn("EC2 instance lookup failed", "addresses", len(b.addrs), "pages", pages, "duration", time.Since(start), "error", err)
		return
	}
	b.results = l.answers(b.addrs, instances)
	var found int
	for _, a := range b.results {
		if a.err == nil {
			found++
		}
	}
	l.log.Debug("EC2 instance lookup", "addresses", len(b.addrs), "instances", len(instances), "records", found,
		"pages", pages, "duration", time.Since(start))
}

// Filter names of DescribeInstances. private-ip-address matches only the instance's primary address;
// network-interface.addresses.private-ip-address matches every private IPv4 address of every interface,
// which a node may connect from (the primary address of any of its interfaces) and which a pod may (a
// secondary one): the lookup finds both, and answers tells them apart.
const (
	filterAddress = "network-interface.addresses.private-ip-address"
	filterState   = "instance-state-name"
	filterVPC     = "vpc-id"
)

// maxPages stops a DescribeInstances pagination that does not end. A batch matches at most BatchSize
// (≤ 200) instances, at least 5 a page.
const maxPages = 100

// describe pages through DescribeInstances for addrs; held says the first page's turn was waited for.
func (l *Lookup) describe(ctx context.Context, addrs []netip.Addr, held bool) ([]types.Instance, int, error) {
	values := make([]string, len(addrs))
	for i, a := range addrs {
		values[i] = a.String()
	}
	in := &ec2.DescribeInstancesInput{
		Filters: []types.Filter{
			{Name: aws.String(filterAddress), Values: values},
			{Name: aws.String(filterState), Values: []string{string(types.InstanceStateNameRunning)}},
			{Name: aws.String(filterVPC), Values: []string{l.cfg.VPCID}},
		},
		MaxResults: aws.Int32(l.cfg.PageSize),
	}
	var (
		instances []types.Instance
		seen      = map[string]bool{}
	)
	for pages := 0; ; {
		if pages == maxPages {
			return nil, pages, fmt.Errorf("DescribeInstances returned more than %d pages for %d addresses", maxPages, len(addrs))
		}
		if pages > 0 || !held {
			if err := l.describeRL.Wait(ctx); err != nil {
				return nil, pages, fmt.Errorf("the join service's own pacing of DescribeInstances (%v calls a second): %w", l.cfg.DescribeRate, err)
			}
		}
		out, err := l.cfg.API.DescribeInstances(ctx, in)
		if err != nil {
			return nil, pages, apiError("DescribeInstances", err)
		}
		pages++
		for _, r := range out.Reservations {
			instances = append(instances, r.Instances...)
		}
		next := aws.ToString(out.NextToken)
		if next == "" {
			return instances, pages, nil
		}
		if seen[next] {
			return nil, pages, errors.New("DescribeInstances returned the same page token twice")
		}
		seen[next] = true
		in.NextToken = aws.String(next)
	}
}

// answers maps every private IPv4 address of the instances EC2 returned back to the addresses asked for.
func (l *Lookup) answers(addrs []netip.Addr, instances []types.Instance) map[netip.Addr]answer {
	owner := map[netip.Addr]int{}
	conflict := map[netip.Addr]string{}
	primary := map[netip.Addr]bool{}
	for i, inst := range instances {
		for _, a := range interfaceAddresses(inst) {
			primary[a] = true
		}
		for _, a := range privateAddresses(inst) {
			if j, ok := owner[a]; ok && j != i {
				conflict[a] = fmt.Sprintf("EC2 reports %s on both %s and %s", a,
					bounded(aws.ToString(instances[j].InstanceId)), bounded(aws.ToString(inst.InstanceId)))
				continue
			}
			owner[a] = i
		}
	}
	records := make(map[int]answer, len(instances))
	results := make(map[netip.Addr]answer, len(addrs))
	for _, a := range addrs {
		if c, ok := conflict[a]; ok {
			// Not "not found": two running instances never share an address, so EC2's view is in flux.
			results[a] = answer{err: errors.New(c)}
			continue
		}
		i, ok := owner[a]
		if !ok {
			results[a] = answer{err: fmt.Errorf("%w: no running instance in %s has the private address %s", metadata.ErrNotFound, l.cfg.VPCID, a)}
			continue
		}
		if !primary[a] {
			results[a] = answer{err: fmt.Errorf("%w: %s is a secondary address of instance %s, which the VPC CNI gives to pods; a node joins from the primary address of one of its interfaces",
				metadata.ErrNotFound, a, bounded(aws.ToString(instances[i].InstanceId)))}
			continue
		}
		r, ok := records[i]
		if !ok {
			inst, err := l.record(instances[i])
			r = answer{inst: inst, err: err}
			records[i] = r
			if err != nil {
				// A running instance of the cluster's VPC that gets no role (its autoscaling group is not
				// listed, or it has none) is an operator's matter: the join service's admission refuses it
				// before any exchange and logs only counts, so this line is the one that says why. The join
				// service's cache asks about an address at most every few seconds.
				l.log.Warn("EC2 instance refused", "address", a, "instance", bounded(aws.ToString(instances[i].InstanceId)), "reason", err)
			}
		}
		results[a] = r
	}
	return results
}

// record turns what EC2 says about an instance into its record, or says why it has none.
func (l *Lookup) record(inst types.Instance) (*metadata.Instance, error) {
	id := aws.ToString(inst.InstanceId)
	// The filters keep these out already; checking again costs nothing and does not rely on them.
	if vpc := aws.ToString(inst.VpcId); vpc != l.cfg.VPCID {
		return nil, fmt.Errorf("%w: instance %s is in VPC %q, not %s", metadata.ErrNotFound, bounded(id), bounded(vpc), l.cfg.VPCID)
	}
	if inst.State == nil || inst.State.Name != types.InstanceStateNameRunning {
		var state types.InstanceStateName
		if inst.State != nil {
			state = inst.State.Name
		}
		return nil, fmt.Errorf("%w: instance %s is %q, not running", metadata.ErrNotFound, bounded(id), bounded(string(state)))
	}
	var (
		group  string
		tagged int
	)
	for _, t := range inst.Tags {
		// Only this key, exactly: any other tag, whatever it is called, can be written by the account's users.
		if aws.ToString(t.Key) == GroupTag {
			group = aws.ToString(t.Value)
			tagged++
		}
	}
	switch {
	case tagged == 0:
		return nil, fmt.Errorf("%w: instance %s is in no autoscaling group (it has no %s tag); roles are given to the instances of the groups %s only",
			metadata.ErrNotFound, bounded(id), GroupTag, l.groups)
	case tagged > 1:
		return nil, fmt.Errorf("%w: instance %s has %d %s tags", metadata.ErrNotFound, bounded(id), tagged, GroupTag)
	}
	role, ok := l.cfg.Roles[group]
	if !ok {
		return nil, fmt.Errorf("%w: instance %s is in autoscaling group %q, which has no role here; the configured groups are %s",
			metadata.ErrNotFound, bounded(id), bounded(group), l.groups)
	}
	rec := &metadata.Instance{
		Name:      aws.ToString(inst.PrivateDnsName),
		Role:      role,
		Addresses: privateAddresses(inst),
		ImageID:   aws.ToString(inst.ImageId),
		ID:        id,
	}
	if err := rec.Validate(); err != nil {
		return nil, fmt.Errorf("%w: EC2's record of instance %s is not a usable node identity: %w", metadata.ErrNotFound, bounded(id), err)
	}
	return rec, nil
}

// privateAddresses lists the private IPv4 addresses of inst: its primary address first, then those of its
// network interfaces in attachment order, each interface's primary one first. Anything that is not an
// IPv4 address is left out.
func privateAddresses(inst types.Instance) []netip.Addr {
	var out []netip.Addr
	seen := map[netip.Addr]bool{}
	add := func(s *string) {
		a, err := netip.ParseAddr(aws.ToString(s))
		if err != nil || !a.Is4() || seen[a] {
			return
		}
		seen[a] = true
		out = append(out, a)
	}
	add(inst.PrivateIpAddress)
	nics := slices.Clone(inst.NetworkInterfaces)
	slices.SortStableFunc(nics, func(a, b types.InstanceNetworkInterface) int {
		ca, da := attachmentOrder(a)
		cb, db := attachmentOrder(b)
		if c := cmp.Compare(ca, cb); c != 0 {
			return c
		}
		return cmp.Compare(da, db)
	})
	for _, nic := range nics {
		add(nic.PrivateIpAddress)
		primaryFirst := slices.Clone(nic.PrivateIpAddresses)
		slices.SortStableFunc(primaryFirst, func(a, b types.InstancePrivateIpAddress) int {
			pa, pb := aws.ToBool(a.Primary), aws.ToBool(b.Primary)
			switch {
			case pa == pb:
				return 0
			case pa:
				return -1
			}
			return 1
		})
		for _, p := range primaryFirst {
			add(p.PrivateIpAddress)
		}
	}
	return out
}

// interfaceAddresses lists the primary private IPv4 address of inst and of each of its network interfaces.
func interfaceAddresses(inst types.Instance) []netip.Addr {
	primaries := []*string{inst.PrivateIpAddress}
	for _, nic := range inst.NetworkInterfaces {
		primaries = append(primaries, nic.PrivateIpAddress)
	}
	var out []netip.Addr
	for _, s := range primaries {
		if a, err := netip.ParseAddr(aws.ToString(s)); err == nil && a.Is4() {
			out = append(out, a)
		}
	}
	return out
}

// attachmentOrder sorts interfaces by network card, then device index; detached ones (never in a running
// instance's answer) last.
func attachmentOrder(nic types.InstanceNetworkInterface) (card, device int32) {
	if nic.Attachment == nil || nic.Attachment.DeviceIndex == nil {
		return math.MaxInt32, math.MaxInt32
	}
	return aws.ToInt32(nic.Attachment.NetworkCardIndex), *nic.Attachment.DeviceIndex
}

// copyOf keeps the waiters of one batch from changing each other's record.
func copyOf(inst *metadata.Instance) *metadata.Instance {
	c := *inst
	c.Addresses = slices.Clone(inst.Addresses)
	return &c
}

// bounded keeps strings from EC2 or the configuration short in errors and logs.
func bounded(s string) string {
	const limit = 200
	if len(s) <= limit {
		return s
	}
	return strings.ToValidUTF8(s[:limit], "") + "…"
}

func isControl(r rune) bool {
	return r < 0x20 || r == 0x7f
}

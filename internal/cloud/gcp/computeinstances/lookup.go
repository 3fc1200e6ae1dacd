// Package computeinstances is the join service's view of a node on Google Compute Engine: the instance
// record of a connecting address, and the endorsement key of an instance's Shielded VM vTPM, both from
// Compute Engine's own API through Google's Go client.
//
// Trust model. The join service trusts Compute Engine's API, which it reaches with its own credentials (the
// service account of the control-plane instances, from the metadata server) over TLS to Google's endpoint.
// A node's role comes from the one fact no node can write: membership of a managed instance group, as the
// group itself lists it (listManagedInstances). A managed group holds only the instances it created from
// its own template; nothing adds an existing instance to it. Instance metadata is never read for a role:
// its created-by key names the group too, but metadata is writable by anyone allowed
// compute.instances.setMetadata on the instance, which includes a node running as the default compute
// service account with the Editor role, so a worker could claim the control plane's group there. Labels
// and network tags are ignored for the same reason. A node cannot change its instance id, its zone or its
// internal addresses either. The EK comes from getShieldedInstanceIdentity, which reports the key of the
// vTPM Google attached to that instance: a node proves it holds that TPM by credential activation,
// elsewhere. What remains trusted is the project's IAM: whoever may change the listed groups' templates, or
// resize them, decides which instances get a role.
//
// The node name is the instance name, as on GKE and with cloud-provider-gcp, whose node names are the
// instance names (unique in a zone; a cluster whose groups span zones must keep names unique, which the
// managed groups' generated names do). The record has no image id: the instance resource does not name
// its boot disk's image (that is on the disk, one more call per instance), and sourceMachineImage names a
// machine image, not the image a group's template boots. What the node booted is measured and attested.
//
// Cost. The join service already puts an instancecache in front of every lookup (a few seconds of memory,
// one call per address at a time, "not found" remembered too). Compute Engine cannot be asked for the
// instance of an address in one call (instances are listed per zone or aggregated, filtered on fields of
// the instance itself, and an address is a field of a nested interface), so this package keeps an index of
// the project's running instances instead, built from instances.aggregatedList (every page) and each
// configured group's listManagedInstances. A lookup of an address the index does not hold refreshes it:
// misses that arrive together share one refresh, and a refresh starts at most once per MinRefreshInterval,
// so a join storm of a thousand nodes costs one refresh per interval, (pages + groups) calls, not a
// thousand. Calls are paced below Compute Engine's per-minute quota, shared with every other client of
// the project. An index older than MaxIndexAge answers nothing, so a record of a deleted instance does not
// outlive it for long (an internal address can be given to a new instance soon after). A vTPM's identity
// never changes in an instance's life, so it is cached for minutes.
package computeinstances

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"
	compute "google.golang.org/api/compute/v1"

	"github.com/berthlabs/berth/internal/metadata"
)

// Defaults and limits of Config.
const (
	// DefaultMinRefreshInterval is how often at most a miss refreshes the index: short enough that a node
	// whose instance just started waits little, long enough that a storm's misses share refreshes.
	DefaultMinRefreshInterval = 2 * time.Second
	// DefaultMaxIndexAge is how long an index answers. Compute Engine can give a deleted instance's internal
	// address to a new instance within minutes; a record that old must not be given for it. A join service
	// in use refreshes about that often, one refresh a minute.
	DefaultMaxIndexAge = time.Minute
	// DefaultRefreshTimeout bounds one refresh, every page and retry: a project of 10,000 instances takes
	// 20 pages, a few seconds. Lookups stop waiting when their own context ends; the refresh goes on.
	DefaultRefreshTimeout = time.Minute
	// DefaultMaxInstances bounds the index: a project listing more running instances than this is refused
	// (raise it), so that an endpoint that never stops answering cannot fill memory.
	DefaultMaxInstances = 100_000
	// MaxPageSize is Compute Engine's largest maxResults, and the default.
	MaxPageSize = 500
	// DefaultCallTimeout bounds one identity request, retries included, below the join service's 30 s
	// exchange timeout.
	DefaultCallTimeout = 20 * time.Second
	// DefaultIdentityCacheTTL is how long a vTPM identity is remembered. It never changes while the instance
	// lives, and instance ids are never reused, so the TTL only bounds memory held for deleted instances.
	DefaultIdentityCacheTTL = 10 * time.Minute
	// DefaultIdentityCacheSize bounds the identity cache; more nodes than this joining within the TTL only
	// cost calls.
	DefaultIdentityCacheSize = 4096
	// DefaultListRate, DefaultIdentityRate and DefaultBurst pace calls. Compute Engine's rate quotas are per
	// project and minute, by group of methods (by default about 1,500 reads a minute, 25 a second), and
	// shared with every other client of the project; the join service takes a fifth of that for lists,
	// which a refresh makes in a row, and two fifths for identities, one per joining node.
	DefaultListRate     rate.Limit = 5
	DefaultIdentityRate rate.Limit = 10
	DefaultBurst                   = 10
)

// Config configures a Lookup; Service, Project, Network and Groups are required, every other field has a
// default.
type Config struct {
	Service *compute.Service
	// Project is the id of the project whose instances join.
	Project string
	// Network is the VPC network of the cluster's nodes: a network name of Project, or
	// "projects/<host project>/global/networks/<name>" for a Shared VPC network. Instances are indexed by
	// the internal addresses of their interfaces on it; other interfaces, and instances with none on it,
	// are never found.
	Network string
	// Groups maps managed instance groups, "<region or zone>/<name>" (metadata.ValidateInstanceGroup), to
	// the role of their instances. An instance in no listed group has no record.
	Groups map[string]metadata.Role
	Logger *slog.Logger
	// Clock is the time index age, refresh intervals and identity cache expiry go by (time.Now if nil).
	Clock func() time.Time

	// MinRefreshInterval is the least time between the starts of two refreshes.
	MinRefreshInterval time.Duration
	// MaxIndexAge is the age beyond which the index answers nothing until refreshed; at least
	// MinRefreshInterval.
	MaxIndexAge time.Duration
	// RefreshTimeout bounds one refresh.
	RefreshTimeout time.Duration
	// MaxInstances bounds the running instances of the project a refresh accepts, and the managed instances
	// of the groups together.
	MaxInstances int
	// PageSize is maxResults of the list calls, 1 to MaxPageSize.
	PageSize int64
	// CallTimeout bounds one identity request, retries included.
	CallTimeout time.Duration
	// IdentityCacheTTL and IdentityCacheSize bound the identity cache.
	IdentityCacheTTL  time.Duration
	IdentityCacheSize int
	// ListRate paces list calls (pages of aggregatedList and listManagedInstances), IdentityRate
	// getShieldedInstanceIdentity calls, each with Burst (the retries of one call are its own). rate.Inf
	// turns pacing off.
	ListRate     rate.Limit
	IdentityRate rate.Limit
	Burst        int
}

// group is a configured managed instance group.
type group struct {
	key      string // "<region or zone>/<name>"
	location string
	name     string
	zonal    bool
	role     metadata.Role
}

// Lookup finds Compute Engine instances by internal address and reports their vTPM's EK. It is safe for
// concurrent use, and implements the join service's InstanceLookup and attest.EKPublicSource.
type Lookup struct {
	cfg        Config
	log        *slog.Logger
	groups     []group
	groupNames string // the configured groups, for errors
	network    string // projects/<project>/global/networks/<name>
	listRL     *rate.Limiter
	*Identities

	mu       sync.Mutex
	idx      *index    // the last index built, nil before the first
	started  time.Time // when the last refresh started
	lastErr  error     // the last refresh's error, nil if it succeeded
	inflight *refresh
}

// refresh is one rebuild of the index; idx and err are written before done is closed and read after.
type refresh struct {
	done chan struct{}
	idx  *index
	err  error
}

var (
	// Project ids are 6 to 30 lowercase letters, digits and hyphens, starting with a letter; old ones may
	// carry a domain ("example.com:project").
	projectPattern = regexp.MustCompile(`^(?:[a-z0-9][-a-z0-9.]{0,61}[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$`)
	// Resource names (networks, instances, groups) are RFC 1035 labels.
	namePattern = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
	// Zones are "<region>-<letter>" (europe-west1-b); a few more letters and digits after it are let
	// through, so that an instance of a zone named otherwise is refused with a reason, not left out.
	zonePattern = regexp.MustCompile(`^[a-z]+-[a-z]+[0-9]+-[a-z][a-z0-9]{0,7}$`)
)

// New checks cfg and fills in its defaults.
func New(cfg Config) (*Lookup, error) {
	if cfg.Service == nil {
		return nil, errors.New("computeinstances: Service is required")
	}
	if !projectPattern.MatchString(cfg.Project) {
		return nil, fmt.Errorf("computeinstances: project id %q is not a Compute Engine project id", bounded(cfg.Project))
	}
	network, err := networkPath(cfg.Project, cfg.Network)
	if err != nil {
		return nil, fmt.Errorf("computeinstances: %w", err)
	}
	if len(cfg.Groups) == 0 {
		return nil, errors.New("computeinstances: no managed instance group has a role: every instance would be refused")
	}
	var groups []group
	for key, role := range cfg.Groups {
		if err := metadata.ValidateInstanceGroup(key); err != nil {
			return nil, fmt.Errorf("computeinstances: %w", err)
		}
		if !role.Valid() {
			return nil, fmt.Errorf("computeinstances: instance group %q: role %q is not %q or %q", key, bounded(string(role)), metadata.RoleControlPlane, metadata.RoleWorker)
		}
		location, name, _ := strings.Cut(key, "/")
		groups = append(groups, group{key: key, location: location, name: name, zonal: zonePattern.MatchString(location), role: role})
	}
	slices.SortFunc(groups, func(a, b group) int { return strings.Compare(a.key, b.key) })
	keys := make([]string, len(groups))
	for i, g := range groups {
		keys[i] = g.key
	}

	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"min refresh interval", &cfg.MinRefreshInterval, DefaultMinRefreshInterval},
		{"max index age", &cfg.MaxIndexAge, DefaultMaxIndexAge},
		{"refresh timeout", &cfg.RefreshTimeout, DefaultRefreshTimeout},
		{"call timeout", &cfg.CallTimeout, DefaultCallTimeout},
		{"identity cache TTL", &cfg.IdentityCacheTTL, DefaultIdentityCacheTTL},
	} {
		switch {
		case *d.v < 0:
			return nil, fmt.Errorf("computeinstances: %s %v is negative", d.name, *d.v)
		case *d.v == 0:
			*d.v = d.def
		}
	}
	if cfg.MaxIndexAge < cfg.MinRefreshInterval {
		return nil, fmt.Errorf("computeinstances: max index age %v is shorter than the min refresh interval %v: misses in between would answer from an index too old to use", cfg.MaxIndexAge, cfg.MinRefreshInterval)
	}
	switch {
	case cfg.PageSize == 0:
		cfg.PageSize = MaxPageSize
	case cfg.PageSize < 1 || cfg.PageSize > MaxPageSize:
		return nil, fmt.Errorf("computeinstances: page size %d is not between 1 and %d (Compute Engine's maxResults)", cfg.PageSize, MaxPageSize)
	}
	for _, n := range []struct {
		name string
		v    *int
		def  int
	}{
		{"max instances", &cfg.MaxInstances, DefaultMaxInstances},
		{"identity cache size", &cfg.IdentityCacheSize, DefaultIdentityCacheSize},
		{"burst", &cfg.Burst, DefaultBurst},
	} {
		switch {
		case *n.v < 0:
			return nil, fmt.Errorf("computeinstances: %s %d is negative", n.name, *n.v)
		case *n.v == 0:
			*n.v = n.def
		}
	}
	if cfg.ListRate < 0 || cfg.IdentityRate < 0 {
		return nil, fmt.Errorf("computeinstances: rate %v or %v is negative", cfg.ListRate, cfg.IdentityRate)
	}
	if cfg.ListRate == 0 {
		cfg.ListRate = DefaultListRate
	}
	if cfg.IdentityRate == 0 {
		cfg.IdentityRate = DefaultIdentityRate
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// A copy, so that a caller changing its map later cannot change roles behind the checks above.
	cfg.Groups = maps.Clone(cfg.Groups)
	log = log.With("subsystem", "computeinstances", "project", cfg.Project, "network", network)
	return &Lookup{
		cfg:        cfg,
		log:        log,
		groups:     groups,
		groupNames: strings.Join(keys, ", "),
		network:    network,
		listRL:     rate.NewLimiter(cfg.ListRate, cfg.Burst),
		Identities: newIdentities(cfg.Service, log, cfg.Clock, cfg.IdentityCacheTTL, cfg.IdentityCacheSize, cfg.CallTimeout, cfg.IdentityRate, cfg.Burst),
	}, nil
}

// networkPath returns "projects/<project>/global/networks/<name>" for a network as Config gives it.
func networkPath(project, network string) (string, error) {
	if namePattern.MatchString(network) {
		return "projects/" + project + "/global/networks/" + network, nil
	}
	parts := strings.Split(network, "/")
	if len(parts) == 5 && parts[0] == "projects" && projectPattern.MatchString(parts[1]) && parts[2] == "global" &&
		parts[3] == "networks" && namePattern.MatchString(parts[4]) {
		return network, nil
	}
	return "", fmt.Errorf("network %q is neither a network name nor projects/<project>/global/networks/<name>", bounded(network))
}

// InstanceByAddress returns the record of the running instance of the project that has addr as the
// internal address of an interface on the network. An address no such instance has, or whose instance has
// no role, gives an error wrapping metadata.ErrNotFound; failures to ask Compute Engine, and answers in
// which the address may be missing only because a zone did not answer, give other errors.
func (l *Lookup) InstanceByAddress(ctx context.Context, addr netip.Addr) (*metadata.Instance, error) {
	addr = addr.Unmap()
	if !addr.Is4() {
		// An interface's networkIP is IPv4; nodes join over it.
		return nil, fmt.Errorf("%w: %s is not an IPv4 address; Compute Engine instances are looked up by internal IPv4 address", metadata.ErrNotFound, addr)
	}
	if err := context.Cause(ctx); err != nil {
		return nil, fmt.Errorf("looking up %s on Compute Engine: %w", addr, err)
	}
	l.mu.Lock()
	now := l.cfg.Clock()
	if idx := l.idx; idx != nil && now.Sub(idx.built) < l.cfg.MaxIndexAge {
		if e, ok := idx.addrs[addr]; ok {
			l.mu.Unlock()
			return l.answer(addr, e)
		}
	}
	r := l.inflight
	if r == nil {
		if !l.started.IsZero() && now.Sub(l.started) < l.cfg.MinRefreshInterval {
			// The last refresh is recent: its answer stands. It succeeded (so the index is the fresh one it
			// built) or failed.
			idx, err := l.idx, l.lastErr
			l.mu.Unlock()
			if err != nil {
				return nil, fmt.Errorf("looking up %s on Compute Engine: %w", addr, err)
			}
			return l.miss(addr, idx)
		}
		r = &refresh{done: make(chan struct{})}
		l.inflight, l.started = r, now
		go l.run(r, now)
	}
	l.mu.Unlock()

	select {
	case <-r.done:
	case <-ctx.Done():
		// The refresh goes on for the others waiting for it.
		return nil, fmt.Errorf("looking up %s on Compute Engine: %w", addr, context.Cause(ctx))
	}
	if r.err != nil {
		return nil, fmt.Errorf("looking up %s on Compute Engine: %w", addr, r.err)
	}
	if e, ok := r.idx.addrs[addr]; ok {
		return l.answer(addr, e)
	}
	return l.miss(addr, r.idx)
}

// answer turns an index entry into a lookup's result. Each caller gets its own copy of the record.
func (l *Lookup) answer(addr netip.Addr, e *entry) (*metadata.Instance, error) {
	if e.err != nil {
		if errors.Is(e.err, metadata.ErrNotFound) {
			// A running instance on the cluster's network that gets no role is an operator's matter: the join
			// service's admission refuses it before any exchange and logs only counts, so this line is the one
			// that says why. The join service's cache asks about an address at most every few seconds.
			l.log.Warn("Compute Engine instance refused", "address", addr, "reason", e.err)
		}
		return nil, e.err
	}
	c := *e.rec
	c.Addresses = slices.Clone(e.rec.Addresses)
	return &c, nil
}

// miss answers for an address the index does not hold.
func (l *Lookup) miss(addr netip.Addr, idx *index) (*metadata.Instance, error) {
	if len(idx.unreachable) > 0 {
		// Not "not found", which the join service's cache would keep: the instance may be in a zone that did
		// not answer.
		return nil, fmt.Errorf("no running instance of project %s has the address %s on network %s, but Compute Engine could not list %s",
			l.cfg.Project, addr, l.network, bounded(strings.Join(idx.unreachable, ", ")))
	}
	return nil, fmt.Errorf("%w: no running instance of project %s has the address %s on network %s",
		metadata.ErrNotFound, l.cfg.Project, addr, l.network)
}

// run rebuilds the index and hands it to the waiters of r. It runs on its own context: a lookup whose
// caller gives up must not fail the others. It logs before it answers, so that the refresh's line comes
// before anything its waiters log.
func (l *Lookup) run(r *refresh, start time.Time) {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.RefreshTimeout)
	defer cancel()
	t0 := time.Now()
	idx, st, err := l.build(ctx, start)
	if err != nil {
		l.log.Warn("Compute Engine index refresh failed", "calls", st.calls, "duration", time.Since(t0), "error", err)
	} else {
		level := slog.LevelDebug
		if len(idx.unreachable) > 0 {
			level = slog.LevelWarn
		}
		l.log.Log(ctx, level, "Compute Engine index refreshed", "instances", st.instances, "on_network", st.onNetwork,
			"addresses", len(idx.addrs), "calls", st.calls, "unreachable", idx.unreachable, "duration", time.Since(t0))
	}
	l.mu.Lock()
	if err == nil {
		l.idx = idx
	}
	l.lastErr = err
	l.inflight = nil
	r.idx, r.err = idx, err
	l.mu.Unlock()
	close(r.done)
}

// index maps internal addresses on the network to what a lookup answers.
type index struct {
	built time.Time // when the refresh that built it started: its answers are at least that recent
	addrs map[netip.Addr]*entry
	// unreachable are the zones Compute Engine could not list, whose instances may be missing.
	unreachable []string
}

// entry is a record, or why an address has none.
type entry struct {
	rec *metadata.Instance
	err error
}

// refreshStats are for the refresh's log line.
type refreshStats struct {
	calls     int
	instances int
	onNetwork int
}

// instance is what the index needs of an instance.
type instance struct {
	id    uint64
	name  string
	zone  string
	addrs []netip.Addr // on the network, nic0's first
}

// Fields asked of the list calls: the partial response keeps a page of 500 instances to some 100 KiB
// instead of megabytes. The client ignores any field an endpoint adds.
const (
	instanceFields = "nextPageToken,unreachables,items/*/warning(code,message)," +
		"items/*/instances(id,name,zone,status,networkInterfaces(network,networkIP))"
	managedFields = "nextPageToken,managedInstances(id,instance)"
)

// build lists the running instances and the members of every group, at once, and indexes them.
func (l *Lookup) build(ctx context.Context, start time.Time) (*index, refreshStats, error) {
	var (
		st        refreshStats
		mu        sync.Mutex // guards st.calls
		instances []instance
		listed    int
		unreach   []string
		members   = make([]map[uint64]bool, len(l.groups))
		missing   = make([]bool, len(l.groups))
	)
	count := func() {
		mu.Lock()
		st.calls++
		mu.Unlock()
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		var err error
		instances, listed, unreach, err = l.listInstances(gctx, count)
		return err
	})
	for i, grp := range l.groups {
		g.Go(func() error {
			var err error
			members[i], err = l.listMembers(gctx, grp, count)
			if isNotFound(err) {
				// One group gone (renamed, deleted) must not stop the others' joins; its instances get no role,
				// and every refresh says why.
				l.log.Warn("configured managed instance group does not exist", "group", grp.key, "error", err)
				missing[i] = true
				return nil
			}
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return nil, st, err
	}
	st.instances, st.onNetwork = listed, len(instances)
	total := 0
	for _, m := range members {
		total += len(m)
	}
	if total > l.cfg.MaxInstances {
		return nil, st, fmt.Errorf("the configured managed instance groups list %d instances, more than the %d the join service accepts", total, l.cfg.MaxInstances)
	}

	idx := &index{built: start, addrs: map[netip.Addr]*entry{}, unreachable: unreach}
	owner := map[netip.Addr]int{}
	for i, inst := range instances {
		e := &entry{}
		e.rec, e.err = l.record(inst, members, missing)
		for _, a := range inst.addrs {
			if j, ok := owner[a]; ok && j != i {
				// Not "not found": two running instances never share an address, so Compute Engine's view is in
				// flux.
				idx.addrs[a] = &entry{err: fmt.Errorf("Compute Engine reports %s on both %s (%s) and %s (%s)", a,
					instances[j].name, instances[j].zone, inst.name, inst.zone)}
				continue
			}
			owner[a] = i
			idx.addrs[a] = e
		}
	}
	return idx, st, nil
}

// record turns what Compute Engine says about an instance into its record, or says why it has none.
func (l *Lookup) record(inst instance, members []map[uint64]bool, missing []bool) (*metadata.Instance, error) {
	var (
		in   []string
		role metadata.Role
	)
	for i, grp := range l.groups {
		if !members[i][inst.id] {
			continue
		}
		if role != "" && grp.role != role {
			return nil, fmt.Errorf("%w: instance %s (%s) is listed by managed instance groups of different roles: %s",
				metadata.ErrNotFound, inst.name, inst.zone, strings.Join(append(in, grp.key), ", "))
		}
		in, role = append(in, grp.key), grp.role
	}
	if role == "" {
		var gone []string
		for i, grp := range l.groups {
			if missing[i] {
				gone = append(gone, grp.key)
			}
		}
		msg := fmt.Sprintf("instance %s (%s) is in none of the managed instance groups that have a role here: %s", inst.name, inst.zone, l.groupNames)
		if len(gone) > 0 {
			msg += fmt.Sprintf(" (of which these do not exist: %s)", strings.Join(gone, ", "))
		}
		return nil, fmt.Errorf("%w: %s", metadata.ErrNotFound, msg)
	}
	rec := &metadata.Instance{
		Name:      inst.name,
		Role:      role,
		Addresses: inst.addrs,
		ID:        InstanceID(l.cfg.Project, inst.zone, inst.id),
	}
	if err := rec.Validate(); err != nil {
		return nil, fmt.Errorf("%w: Compute Engine's record of instance %s (%s) is not a usable node identity: %w", metadata.ErrNotFound, inst.name, inst.zone, err)
	}
	return rec, nil
}

// listInstances pages through instances.aggregatedList for the project's running instances, and keeps
// those with an interface on the network. It returns them, how many were listed in all, and the zones that
// did not answer. Partial success is asked for: without it one unreachable zone would fail every lookup,
// with it only the lookups of addresses that are not found say that a zone was missing.
func (l *Lookup) listInstances(ctx context.Context, count func()) ([]instance, int, []string, error) {
	call := l.cfg.Service.Instances.AggregatedList(l.cfg.Project).
		Filter("status = RUNNING").
		ReturnPartialSuccess(true).
		MaxResults(l.cfg.PageSize).
		Fields(instanceFields)
	var (
		out     []instance
		listed  int
		unreach = map[string]bool{}
		pages   int
		tokens  = map[string]bool{}
	)
	maxPages := l.maxPages()
	for {
		if err := l.pace(ctx, methodAggregatedList); err != nil {
			return nil, 0, nil, err
		}
		count()
		page, err := call.Context(ctx).Do()
		if err != nil {
			return nil, 0, nil, apiError(methodAggregatedList, err)
		}
		pages++
		for _, u := range page.Unreachables {
			unreach[bounded(u)] = true
		}
		for scope, list := range page.Items {
			if list.Warning != nil && list.Warning.Code == "UNREACHABLE" {
				unreach[bounded(scope)] = true
			}
			for _, inst := range list.Instances {
				listed++
				if listed > l.cfg.MaxInstances {
					return nil, 0, nil, fmt.Errorf("Compute Engine lists more than %d running instances in project %s, more than the join service accepts", l.cfg.MaxInstances, l.cfg.Project)
				}
				if i, ok := l.instanceOf(inst); ok {
					out = append(out, i)
				}
			}
		}
		next := page.NextPageToken
		switch {
		case next == "":
			return out, listed, slices.Sorted(maps.Keys(unreach)), nil
		case tokens[next]:
			return nil, 0, nil, fmt.Errorf("Compute Engine %s returned the same page token twice", methodAggregatedList)
		case pages >= maxPages:
			return nil, 0, nil, fmt.Errorf("Compute Engine %s returned more than %d pages", methodAggregatedList, maxPages)
		}
		tokens[next] = true
		call.PageToken(next)
	}
}

// maxPages stops a pagination that does not end: MaxInstances in full pages, and as many again, for
// pages an endpoint may send short.
func (l *Lookup) maxPages() int {
	return 2 * (l.cfg.MaxInstances/int(l.cfg.PageSize) + 1)
}

// instanceOf keeps what the index needs of a running instance with an interface on the network, or
// reports that it has none.
func (l *Lookup) instanceOf(inst *compute.Instance) (instance, bool) {
	if inst == nil || inst.Status != "RUNNING" || inst.Id == 0 || !namePattern.MatchString(inst.Name) {
		// The filter keeps instances that are not running out already; checking again costs nothing and does
		// not rely on it. An instance without an id or a valid name is a broken answer.
		return instance{}, false
	}
	zone := lastSegment(inst.Zone)
	if !zonePattern.MatchString(zone) {
		return instance{}, false
	}
	out := instance{id: inst.Id, name: inst.Name, zone: zone}
	seen := map[netip.Addr]bool{}
	for _, nic := range inst.NetworkInterfaces {
		if nic == nil || resourcePath(nic.Network) != l.network {
			continue
		}
		a, err := netip.ParseAddr(nic.NetworkIP)
		if err != nil || !a.Is4() || seen[a] {
			continue
		}
		seen[a] = true
		out.addrs = append(out.addrs, a)
	}
	return out, len(out.addrs) > 0
}

// listMembers returns the ids of the instances a managed instance group lists. Groups answer in one
// response unless their listManagedInstancesResults is PAGINATED; both are followed.
func (l *Lookup) listMembers(ctx context.Context, grp group, count func()) (map[uint64]bool, error) {
	method := methodRegionListManaged
	if grp.zonal {
		method = methodListManagedInstances
	}
	ids := map[uint64]bool{}
	tokens := map[string]bool{}
	maxPages := l.maxPages()
	next := ""
	for pages := 1; ; pages++ {
		if err := l.pace(ctx, method); err != nil {
			return nil, err
		}
		count()
		var (
			managed []*compute.ManagedInstance
			err     error
		)
		if grp.zonal {
			call := l.cfg.Service.InstanceGroupManagers.ListManagedInstances(l.cfg.Project, grp.location, grp.name).
				MaxResults(l.cfg.PageSize).Fields(managedFields).Context(ctx)
			if next != "" {
				call.PageToken(next)
			}
			var resp *compute.InstanceGroupManagersListManagedInstancesResponse
			if resp, err = call.Do(); err == nil {
				managed, next = resp.ManagedInstances, resp.NextPageToken
			}
		} else {
			call := l.cfg.Service.RegionInstanceGroupManagers.ListManagedInstances(l.cfg.Project, grp.location, grp.name).
				MaxResults(l.cfg.PageSize).Fields(managedFields).Context(ctx)
			if next != "" {
				call.PageToken(next)
			}
			var resp *compute.RegionInstanceGroupManagersListInstancesResponse
			if resp, err = call.Do(); err == nil {
				managed, next = resp.ManagedInstances, resp.NextPageToken
			}
		}
		if err != nil {
			return nil, fmt.Errorf("managed instance group %s: %w", grp.key, apiError(method, err))
		}
		for _, m := range managed {
			// An instance the group is still creating has no id yet; it cannot be running either.
			if m != nil && m.Id != 0 {
				ids[m.Id] = true
			}
		}
		if len(ids) > l.cfg.MaxInstances {
			return nil, fmt.Errorf("managed instance group %s lists more than %d instances, more than the join service accepts", grp.key, l.cfg.MaxInstances)
		}
		switch {
		case next == "":
			return ids, nil
		case tokens[next]:
			return nil, fmt.Errorf("managed instance group %s: Compute Engine %s returned the same page token twice", grp.key, method)
		case pages >= maxPages:
			return nil, fmt.Errorf("managed instance group %s: Compute Engine %s returned more than %d pages", grp.key, method, maxPages)
		}
		tokens[next] = true
	}
}

// pace waits for the turn of one list call.
func (l *Lookup) pace(ctx context.Context, method string) error {
	if err := l.listRL.Wait(ctx); err != nil {
		return fmt.Errorf("the join service's own pacing of Compute Engine list calls (%v a second) before %s: %w", l.cfg.ListRate, method, err)
	}
	return nil
}

// InstanceID is the id of an instance in records: "projects/<project>/zones/<zone>/instances/<id>", the
// numeric id Compute Engine gave the instance (never reused, unlike its name). The EK source parses it.
func InstanceID(project, zone string, id uint64) string {
	return "projects/" + project + "/zones/" + zone + "/instances/" + strconv.FormatUint(id, 10)
}

// ParseInstanceID reads an id InstanceID made.
func ParseInstanceID(s string) (project, zone string, id uint64, err error) {
	parts := strings.Split(s, "/")
	if len(parts) != 6 || parts[0] != "projects" || parts[2] != "zones" || parts[4] != "instances" {
		return "", "", 0, fmt.Errorf("%q is not projects/<project>/zones/<zone>/instances/<numeric id>", bounded(s))
	}
	project, zone = parts[1], parts[3]
	if !projectPattern.MatchString(project) {
		return "", "", 0, fmt.Errorf("%q: %q is not a project id", bounded(s), bounded(project))
	}
	if !zonePattern.MatchString(zone) {
		return "", "", 0, fmt.Errorf("%q: %q is not a zone", bounded(s), bounded(zone))
	}
	id, perr := strconv.ParseUint(parts[5], 10, 64)
	if perr != nil || id == 0 || strconv.FormatUint(id, 10) != parts[5] {
		return "", "", 0, fmt.Errorf("%q: %q is not a numeric instance id", bounded(s), bounded(parts[5]))
	}
	return project, zone, id, nil
}

// resourcePath returns the "projects/…" part of a Compute Engine resource URL
// (https://www.googleapis.com/compute/v1/projects/p/global/networks/n), or "" if it has none.
func resourcePath(link string) string {
	u, err := url.Parse(link)
	if err != nil {
		return ""
	}
	if strings.HasPrefix(u.Path, "projects/") {
		return u.Path
	}
	_, rest, ok := strings.Cut(u.Path, "/projects/")
	if !ok {
		return ""
	}
	return "projects/" + rest
}

// lastSegment returns what follows the last slash of a resource URL.
func lastSegment(link string) string {
	return link[strings.LastIndexByte(link, '/')+1:]
}

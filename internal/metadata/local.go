package metadata

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"sigs.k8s.io/yaml"
)

// Local is a node's view of itself where no metadata service exists (bare metal booted by PXE): the
// user-data comes from the file cloud-init wrote (berth_node_config's `json`), the name is the machine's
// hostname and the address the one it reaches the join service from. Such nodes are workers; the join
// service checks all of it against its own inventory, so nothing here grants anything.
type Local struct {
	// UserDataFile is the user-data JSON, /etc/berth/user-data.json.
	UserDataFile string
	// Address is the node's address; when not set, the source address of a route to the first join
	// endpoint.
	Address netip.Addr
	// Hostname and Route are the machine's (os.Hostname, and a UDP "dial" that only picks a route);
	// replaced in tests.
	Hostname func() (string, error)
	Route    func(endpoint string) (netip.Addr, error)
}

// Self implements the node's metadata reader.
func (l *Local) Self(context.Context) (*Self, error) {
	data, err := readLimited(l.UserDataFile)
	if err != nil {
		return nil, fmt.Errorf("reading user-data: %w", err)
	}
	ud, err := ParseUserData(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", l.UserDataFile, err)
	}
	if len(ud.JoinEndpoints) == 0 {
		return nil, fmt.Errorf("user-data %s names no join endpoint: a node without a metadata service finds the join service only there", l.UserDataFile)
	}
	if ud.Role == RoleControlPlane {
		return nil, fmt.Errorf("user-data %s says control-plane, but machines without a metadata service join as workers", l.UserDataFile)
	}
	hostname := l.Hostname
	if hostname == nil {
		hostname = os.Hostname
	}
	name, err := hostname()
	if err != nil {
		return nil, fmt.Errorf("reading the hostname: %w", err)
	}
	addr := l.Address
	if !addr.IsValid() {
		route := l.Route
		if route == nil {
			route = routeTo
		}
		if addr, err = route(ud.JoinEndpoints[0]); err != nil {
			return nil, fmt.Errorf("finding this node's address towards %s: %w", ud.JoinEndpoints[0], err)
		}
	}
	self := &Self{Instance: Instance{Name: name, Role: RoleWorker, Addresses: []netip.Addr{addr}}, UserData: ud}
	if err := self.Instance.Validate(); err != nil {
		return nil, fmt.Errorf("this machine as a node (hostname and address): %w", err)
	}
	return self, nil
}

// ControlPlanes implements the node's metadata reader: a node without a metadata service knows no other.
func (l *Local) ControlPlanes(context.Context) ([]Instance, error) { return nil, nil }

// routeTo is the local address the kernel picks for a connection to endpoint; no packet is sent.
func routeTo(endpoint string) (netip.Addr, error) {
	c, err := net.Dial("udp", endpoint)
	if err != nil {
		return netip.Addr{}, err
	}
	defer c.Close()
	ap, err := netip.ParseAddrPort(c.LocalAddr().String())
	if err != nil {
		return netip.Addr{}, err
	}
	return ap.Addr().Unmap(), nil
}

// Inventory is the instance records of machines without a metadata service, from a file the operator
// keeps (YAML or JSON, a list of instances): the join service beside an external control plane looks
// nodes up in it. The file is read again when it changes, so machines are added and removed without a
// restart. A file that does not parse fails every lookup until it is fixed: a record the operator meant
// to remove must not keep admitting its machine.
type Inventory struct {
	Path string

	mu      sync.Mutex
	read    bool
	modTime time.Time
	size    int64
	byAddr  map[netip.Addr]Instance
	loadErr error
}

// InstanceByAddress implements the join service's instance lookup.
func (inv *Inventory) InstanceByAddress(_ context.Context, addr netip.Addr) (*Instance, error) {
	addr = addr.Unmap().WithZone("")
	inv.mu.Lock()
	defer inv.mu.Unlock()
	if err := inv.refresh(); err != nil {
		return nil, err
	}
	inst, ok := inv.byAddr[addr]
	if !ok {
		return nil, fmt.Errorf("%w: no record for %s in the inventory", ErrNotFound, addr)
	}
	return &inst, nil
}

func (inv *Inventory) refresh() error {
	fi, err := os.Stat(inv.Path)
	if err != nil {
		return fmt.Errorf("inventory: %w", err)
	}
	if inv.read && fi.ModTime().Equal(inv.modTime) && fi.Size() == inv.size {
		return inv.loadErr
	}
	inv.read, inv.modTime, inv.size = true, fi.ModTime(), fi.Size()
	inv.byAddr, inv.loadErr = ParseInventory(inv.Path)
	return inv.loadErr
}

// ParseInventory reads an inventory file: every record valid, no address on two machines.
func ParseInventory(path string) (map[netip.Addr]Instance, error) {
	data, err := readLimited(path)
	if err != nil {
		return nil, fmt.Errorf("inventory: %w", err)
	}
	var list []Instance
	if err := yaml.UnmarshalStrict(data, &list); err != nil {
		return nil, fmt.Errorf("inventory %s: %w", path, err)
	}
	byAddr := make(map[netip.Addr]Instance)
	names := make(map[string]bool, len(list))
	for i, inst := range list {
		if err := inst.Validate(); err != nil {
			return nil, fmt.Errorf("inventory %s: record %d: %w", path, i, err)
		}
		if names[inst.Name] {
			return nil, fmt.Errorf("inventory %s: %q is listed twice", path, inst.Name)
		}
		names[inst.Name] = true
		for _, a := range inst.Addresses {
			if other, dup := byAddr[a]; dup {
				return nil, fmt.Errorf("inventory %s: address %s belongs to both %q and %q", path, a, other.Name, inst.Name)
			}
			byAddr[a] = inst
		}
	}
	return byAddr, nil
}

func readLimited(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxDocumentSize+1))
	if err != nil {
		return nil, err
	}
	if len(data) > MaxDocumentSize {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, MaxDocumentSize)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, errors.New(path + " is empty")
	}
	return data, nil
}

// ParseUserData reads the user-data JSON that berth_node_config renders, strictly (no unknown field,
// nothing after the object), and validates it.
func ParseUserData(data []byte) (UserData, error) {
	var u UserData
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&u); err != nil {
		return UserData{}, fmt.Errorf("decoding user-data: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return UserData{}, errors.New("decoding user-data: trailing data after the JSON object")
	}
	if err := u.Validate(); err != nil {
		return UserData{}, fmt.Errorf("user-data: %w", err)
	}
	return u, nil
}

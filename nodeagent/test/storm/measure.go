package storm

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Sides of a storm whose CPU time CPUSnapshot tells apart: the join service, and the load it answers
// (agents and TPMs) and writes to (API server and etcd).
const (
	SideService = "join service"
	SideAPI     = "kube-apiserver + etcd"
	SideTPMs    = "swtpm pool"
	SideAgents  = "agents (test process)"
	SideOther   = "other"
)

// Sides lists the sides in the order tables show them.
var Sides = []string{SideService, SideAgents, SideTPMs, SideAPI, SideOther}

// CPUSnapshot is the CPU time used so far by the test process and each of its descendants, by side.
type CPUSnapshot map[string]time.Duration

// TakeCPUSnapshot reads /proc for the test process and its descendants; servicePid is the join service's.
// A process that exited since an earlier snapshot drops out of the later one, so only processes that live
// through a storm (all but the real agents booted beside it) are measured.
func TakeCPUSnapshot(servicePid int) CPUSnapshot {
	self := os.Getpid()
	type proc struct {
		ppid int
		comm string
		cpu  time.Duration
	}
	procs := map[int]proc{}
	dirs, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, path := range dirs {
		data, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		pid, comm, fields, ok := parseStat(data)
		if !ok {
			continue
		}
		ppid, _ := strconv.Atoi(fields[1])
		procs[pid] = proc{ppid: ppid, comm: comm, cpu: statCPU(fields)}
	}
	isDescendant := func(pid int) bool {
		for range 64 {
			if pid == self {
				return true
			}
			p, ok := procs[pid]
			if !ok || pid <= 1 {
				return false
			}
			pid = p.ppid
		}
		return false
	}
	s := CPUSnapshot{}
	for pid, p := range procs {
		if !isDescendant(pid) {
			continue
		}
		switch {
		case pid == self:
			s[SideAgents] += p.cpu
		case pid == servicePid:
			s[SideService] += p.cpu
		case p.comm == "kube-apiserver" || p.comm == "etcd":
			s[SideAPI] += p.cpu
		case p.comm == "swtpm":
			s[SideTPMs] += p.cpu
		default:
			s[SideOther] += p.cpu
		}
	}
	return s
}

// Since is the CPU time each side used between earlier and s.
func (s CPUSnapshot) Since(earlier CPUSnapshot) CPUSnapshot {
	d := CPUSnapshot{}
	for side, cpu := range s {
		d[side] = max(0, cpu-earlier[side])
	}
	return d
}

// parseStat splits /proc/<pid>/stat: the pid, the command name (in parentheses, and it may hold spaces) and
// the fields after it, from the state on (fields[0] is the state, fields[1] the parent's pid).
func parseStat(data []byte) (pid int, comm string, fields []string, ok bool) {
	open, closing := bytes.IndexByte(data, '('), bytes.LastIndexByte(data, ')')
	if open < 0 || closing < open || closing+2 > len(data) {
		return 0, "", nil, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data[:open])))
	if err != nil {
		return 0, "", nil, false
	}
	fields = strings.Fields(string(data[closing+2:]))
	if len(fields) < 13 {
		return 0, "", nil, false
	}
	return pid, string(data[open+1 : closing]), fields, true
}

// statCPU is the user and system time in the fields parseStat returns.
func statCPU(fields []string) time.Duration {
	utime, _ := strconv.ParseInt(fields[11], 10, 64)
	stime, _ := strconv.ParseInt(fields[12], 10, 64)
	const clockTicks = 100 // USER_HZ on Linux
	return time.Duration(utime+stime) * time.Second / clockTicks
}

// Connections samples, from the kernel, the connections to the listening TCP socket at addr (IPv4): those
// established (whether the process accepted them or not) and those in its accept queue, not yet accepted.
// Only the test process asks: sampling costs the join service nothing, which scraping its metrics every few
// milliseconds would not.
type Connections struct {
	addr       netip.AddrPort
	stop, done chan struct{}
	mu         sync.Mutex
	most       ConnectionCounts
}

// ConnectionCounts are what one sample of Connections saw, or the most of each over the samples.
type ConnectionCounts struct {
	Established, AcceptQueue int
}

// WatchConnections samples addr's connections every 50 ms until Stop.
func WatchConnections(addr netip.AddrPort) *Connections {
	c := &Connections{addr: addr, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			if n, ok := countConnections(c.addr); ok {
				c.mu.Lock()
				c.most.Established = max(c.most.Established, n.Established)
				c.most.AcceptQueue = max(c.most.AcceptQueue, n.AcceptQueue)
				c.mu.Unlock()
			}
			select {
			case <-c.stop:
				return
			case <-tick.C:
			}
		}
	}()
	return c
}

// Stop ends the sampling and returns the most of each count seen.
func (c *Connections) Stop() ConnectionCounts {
	close(c.stop)
	<-c.done
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.most
}

// ListenBacklog is the longest accept queue a Go listener gets: the system's somaxconn, which Go asks for.
func ListenBacklog() int {
	data, err := os.ReadFile("/proc/sys/net/core/somaxconn")
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return min(n, 1<<16-1)
}

// countConnections asks the kernel (sock_diag over netlink) for the IPv4 TCP sockets established or
// listening, and counts those whose local end is addr: the connections established to it and the accept
// queue of the socket listening there. The kernel leaves out the thousands of sockets a storm leaves in
// TIME_WAIT, which make reading /proc/net/tcp cost the load side a third of its CPU. ok is false when nothing
// listens at addr or the kernel cannot be asked.
func countConnections(addr netip.AddrPort) (n ConnectionCounts, ok bool) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_INET_DIAG)
	if err != nil {
		return n, false
	}
	defer unix.Close(fd)
	const (
		sockDiagByFamily = 20 // SOCK_DIAG_BY_FAMILY
		tcpEstablished   = 1
		tcpListen        = 10
		hdrLen           = unix.SizeofNlMsghdr
		reqLen           = 56 // struct inet_diag_req_v2
	)
	req := make([]byte, hdrLen+reqLen)
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], sockDiagByFamily)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	req[hdrLen], req[hdrLen+1] = unix.AF_INET, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(req[hdrLen+4:], 1<<tcpEstablished|1<<tcpListen)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return n, false
	}
	ip := addr.Addr().As4()
	buf := make([]byte, 1<<16)
	for {
		size, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return n, false
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:size])
		if err != nil {
			return n, false
		}
		for _, m := range msgs {
			switch m.Header.Type {
			case unix.NLMSG_DONE:
				return n, ok
			case unix.NLMSG_ERROR:
				return n, false
			}
			// struct inet_diag_msg: family, state, timer, retrans; the socket id (source port and address in
			// network order at 4 and 8); expires; the receive queue at 56.
			d := m.Data
			if len(d) < 60 || binary.BigEndian.Uint16(d[4:]) != addr.Port() || [4]byte(d[8:12]) != ip {
				continue
			}
			switch d[1] {
			case tcpEstablished:
				n.Established++
			case tcpListen:
				n.AcceptQueue, ok = int(binary.NativeEndian.Uint32(d[56:])), true
			}
		}
	}
}

package lab

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
)

// Down removes every process, namespace, veth, bridge, cgroup, mount and directory a lab in dir made. It
// works from the host's state, not from a Lab value, so it also cleans up after a lab whose command died.
func Down(ctx context.Context, dir string) error {
	if os.Geteuid() != 0 {
		return errors.New("taking the lab down needs root")
	}
	var errs []error
	if left := killProcesses("", 15*time.Second); len(left) > 0 {
		errs = append(errs, fmt.Errorf("processes still alive after SIGKILL: %v", left))
	}
	for _, ns := range labNetns() {
		if _, err := run(ctx, "ip", "netns", "del", ns); err != nil {
			errs = append(errs, err)
		}
	}
	// A namespace goes, and its veths with it, only once the kernel has let go of it, which can take longer
	// than Down: removing the host's ends now takes both.
	for _, veth := range labVeths() {
		if _, err := run(ctx, "ip", "link", "del", veth); err != nil && slices.Contains(labVeths(), veth) {
			errs = append(errs, err)
		}
	}
	if _, err := run(ctx, "ip", "link", "show", bridgeName); err == nil {
		if _, err := run(ctx, "ip", "link", "del", bridgeName); err != nil {
			errs = append(errs, err)
		}
	}
	for _, m := range labMounts(dir) {
		if _, err := run(ctx, "umount", "-l", m); err != nil {
			errs = append(errs, err)
		}
	}
	if err := removeCgroups(""); err != nil {
		errs = append(errs, fmt.Errorf("cgroups: %w", err))
	}
	if data, err := os.ReadFile(dir + "/host-dirs"); err == nil {
		lines := strings.Split(strings.TrimSpace(string(data)), "\n")
		for i := len(lines) - 1; i >= 0; i-- {
			if lines[i] != "" {
				os.Remove(lines[i]) // only if still empty: it may have been filled by something else since
			}
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// labVeths are the host's ends of the lab's veths.
func labVeths() []string {
	links, err := run(context.Background(), "ip", "-o", "link", "show")
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(links, "\n") {
		// "812: bl-cp-0@if2: <BROADCAST,…": the name ends at the peer's index.
		if f := strings.Fields(l); len(f) > 1 && strings.HasPrefix(f[1], vethPrefix) {
			name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
			out = append(out, name)
		}
	}
	return out
}

// Leftovers lists what of a lab is still on the host; empty after Down.
func Leftovers(dir string) []string {
	var out []string
	for _, p := range cgroupPIDs("") {
		out = append(out, fmt.Sprintf("process %d", p))
	}
	for _, ns := range labNetns() {
		out = append(out, "netns "+ns)
	}
	if _, err := run(context.Background(), "ip", "link", "show", bridgeName); err == nil {
		out = append(out, "bridge "+bridgeName)
	}
	for _, veth := range labVeths() {
		out = append(out, "veth "+veth)
	}
	for _, m := range labMounts(dir) {
		out = append(out, "mount "+m)
	}
	// Nodes' kubelets and CNI write their rules inside their own namespaces; none may reach the host's.
	if rules, err := run(context.Background(), "iptables-save"); err == nil {
		for _, r := range strings.Split(rules, "\n") {
			if strings.Contains(r, bridgeName) || strings.Contains(r, "10.250.0.") || strings.Contains(r, "10.244.") || strings.Contains(r, "cni0") {
				out = append(out, "iptables rule "+r)
			}
		}
	}
	if ctrls, err := cgroupControllers(); err == nil {
		for _, c := range ctrls {
			if _, err := os.Stat(cgroupRoot + "/" + c + "/" + cgroupParent); err == nil {
				out = append(out, "cgroup "+c+"/"+cgroupParent)
			}
		}
	}
	if _, err := os.Stat(dir); err == nil {
		out = append(out, "directory "+dir)
	}
	return out
}

package uki

import (
	"fmt"
	"os"
)

// Artifact is the UKI and the disk that boots it.
type Artifact struct {
	dir, efi, raw string
}

func (a *Artifact) BuilderId() string { return BuilderID }

// Files lists the disk first: it is what a machine is launched from.
func (a *Artifact) Files() []string { return []string{a.raw, a.efi} }

// Id is the disk image's path.
func (a *Artifact) Id() string { return a.raw }

func (a *Artifact) String() string {
	return fmt.Sprintf("disk image %s booting the unified kernel image %s", a.raw, a.efi)
}

func (a *Artifact) State(string) any { return nil }

func (a *Artifact) Destroy() error { return os.RemoveAll(a.dir) }

// Command pause is the lab's pod sandbox: it holds a pod's namespaces open and does nothing else until it
// is told to stop. Built statically, it makes the pause image without pulling one from a registry.
//
// As the lab's test workload it can also leave a mark on its node's storage: with BERTH_LAB_WRITE=<path>
// and BERTH_LAB_CONTENT=<text> it writes the text to the path once, unless the file exists, so that a test
// sees whether the file outlives the node's power cycle untouched.
package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	if path := os.Getenv("BERTH_LAB_WRITE"); path != "" {
		if err := writeOnce(path, os.Getenv("BERTH_LAB_CONTENT")); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	<-stop
}

func writeOnce(path, content string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if errors.Is(err, fs.ErrExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if _, err := f.WriteString(content); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

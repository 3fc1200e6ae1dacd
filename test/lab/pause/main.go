// Command pause is the lab's pod sandbox: it holds a pod's namespaces open and does nothing else until it
// is told to stop. Built statically, it makes the pause image without pulling one from a registry.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}

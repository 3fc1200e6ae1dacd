// Command crash passes two failpoints, for TestCrash.
package main

import (
	"fmt"

	"github.com/berthlabs/berth/nodeagent/internal/failpoint"
)

func main() {
	fmt.Println("before")
	failpoint.Crash("other")
	failpoint.Crash("here")
	fmt.Println("after")
}

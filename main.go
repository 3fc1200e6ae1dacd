// Command terraform-provider-berth is Berth's Terraform provider: Terraform starts it as a plugin and talks
// to it over gRPC. Run it with -debug to attach a debugger (it then prints TF_REATTACH_PROVIDERS to set).
package main

import (
	"context"
	"flag"
	"log"

	"github.com/hashicorp/terraform-plugin-framework/providerserver"

	"github.com/berthlabs/berth/provider"
)

// version is set at build time with -ldflags "-X main.version=…".
var version = "dev"

func main() {
	var debug bool
	flag.BoolVar(&debug, "debug", false, "run the provider for a debugger such as delve")
	flag.Parse()

	err := providerserver.Serve(context.Background(), provider.New(version), providerserver.ServeOpts{
		Address: "registry.terraform.io/berthlabs/berth",
		Debug:   debug,
	})
	if err != nil {
		log.Fatal(err)
	}
}

// Package version is the version of packer-plugin-berth that Packer sees (`packer-plugin-berth describe`).
// The required_plugins installation layout names the binary after it, so `make packer-plugin` and the
// version here must agree.
package version

import "github.com/hashicorp/packer-plugin-sdk/version"

// Version is the release; Prerelease is empty for a release Packer may install.
var (
	Version    = "0.1.0"
	Prerelease = ""
	Metadata   = ""
)

// PluginVersion is what the plugin reports to Packer.
var PluginVersion = version.NewPluginVersion(Version, Prerelease, Metadata)

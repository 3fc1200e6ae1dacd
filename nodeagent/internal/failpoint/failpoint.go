// Package failpoint lets fault tests crash a real berth-agent process at a named point of its work, as a
// power cut or an OOM kill would. Builds without the failpoint tag compile every call to nothing; a binary
// built with -tags failpoint dies by SIGKILL at the point named by the environment variable
// BERTH_FAILPOINT, so that no deferred cleanup runs.
package failpoint

// EnvVar names the failpoint a failpoint build crashes at.
const EnvVar = "BERTH_FAILPOINT"

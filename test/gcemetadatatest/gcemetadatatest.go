// Package gcemetadatatest serves one Compute Engine instance's metadata the way GCE's metadata server does,
// for tests and labs: it answers under /computeMetadata/v1/ only requests that carry Metadata-Flavor:
// Google and no X-Forwarded-For (403 with Google's error page otherwise), marks every answer with
// Metadata-Flavor: Google and Server: Metadata Server for VM, serves values as text, as JSON with ?alt=json,
// directories as listings (redirecting a directory named without its trailing slash) or with
// ?recursive=true as JSON with GCE's camelCase keys, and issues the default service account's access token.
// Google's own metadata client and token source read it as they read GCE's (see its tests).
//
// A Handler serves anywhere: a lab puts it on 169.254.169.254:80 in a node's network namespace. New runs
// one on loopback for a test, to be reached through its URL or, as Google's clients reach it, through
// GCE_METADATA_HOST=Host().
package gcemetadatatest

import (
	"encoding/json"
	"fmt"
	"html"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// NodeConfigKey is the instance metadata key whose value is berth_node_config's json.
const NodeConfigKey = "berth-node-config"

// Prefix is the path under which the metadata server serves v1 of its metadata.
const Prefix = "/computeMetadata/v1/"

// Instance is the instance the server describes. Values are served as they are, empty ones as empty
// values, so that a test can serve what GCE never would.
type Instance struct {
	ID   uint64 // instance/id
	Name string // instance/name; instance/hostname is "<name>.<zone>.c.<project id>.internal"
	Zone string // the zone's name ("europe-west1-b"); instance/zone is "projects/<project number>/zones/<zone>"
	// ProjectID is project/project-id, ProjectNumber project/numeric-project-id.
	ProjectID     string
	ProjectNumber uint64
	// IP is the primary network interface's internal address (instance/network-interfaces/0/ip), Network
	// its network's name (…/0/network is "projects/<project number>/networks/<network>").
	IP, Network string
	// Image is instance/image ("projects/<project>/global/images/<name>"); empty leaves it out.
	Image string
	// NodeConfig is the berth-node-config attribute; nil leaves it out.
	NodeConfig []byte
	// ServiceAccount is the default service account's email, "<project number>-compute@developer.gserviceaccount.com"
	// (Compute Engine's default service account) when empty.
	ServiceAccount string
	// Token is the access token the server issues for the default service account, "ya29.gcemetadatatest"
	// when empty, and TokenLifetime its expires_in, 3599 s (GCE's for a fresh token) when zero.
	Token         string
	TokenLifetime time.Duration
}

// Fault changes how the server answers one path.
type Fault struct {
	// Delay holds the answer back; the request ending (the client giving up) ends the wait with no answer.
	Delay time.Duration
	// Status, if not zero, is answered instead of the value, with Body or else the status's usual body.
	Status int
	// Body, if not nil, is served instead of the value.
	Body []byte
	// NoFlavor leaves Metadata-Flavor: Google out of the answer, as a server that is not GCE's would.
	NoFlavor bool
}

// Handler is the metadata server. It is safe for concurrent use; a test may change it while it serves.
type Handler struct {
	mu            sync.Mutex
	inst          Instance
	faults        map[string]Fault
	tokenRequests int
}

// NewHandler returns a metadata server describing inst.
func NewHandler(inst Instance) *Handler {
	inst.NodeConfig = slices.Clone(inst.NodeConfig)
	return &Handler{inst: inst, faults: map[string]Fault{}}
}

// SetNodeConfig sets the berth-node-config attribute; nil removes it.
func (h *Handler) SetNodeConfig(b []byte) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.inst.NodeConfig = slices.Clone(b)
}

// SetToken sets the access token issued from now on and its lifetime (zero: 3599 s).
func (h *Handler) SetToken(token string, lifetime time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.inst.Token, h.inst.TokenLifetime = token, lifetime
}

// SetFault makes the server answer path (under /computeMetadata/v1/, "instance/id") as f says, until
// ClearFault.
func (h *Handler) SetFault(path string, f Fault) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.faults[path] = f
}

// ClearFault answers path as usual again.
func (h *Handler) ClearFault(path string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.faults, path)
}

// TokenRequests counts the requests for an access token that the server answered with one.
func (h *Handler) TokenRequests() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.tokenRequests
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.mu.Lock()
	inst := h.inst
	fault, faulty := h.faults[strings.TrimPrefix(r.URL.Path, Prefix)]
	h.mu.Unlock()

	if !fault.NoFlavor {
		w.Header().Set("Metadata-Flavor", "Google")
	}
	w.Header().Set("Server", "Metadata Server for VM")
	w.Header().Set("X-Frame-Options", "SAMEORIGIN")
	w.Header().Set("X-XSS-Protection", "0")

	// GCE answers the root without the request header: Google's clients probe it to learn whether they run
	// on GCE, by the answer's Metadata-Flavor.
	if r.URL.Path == "/" {
		writeText(w, "computeMetadata/\n")
		return
	}
	// GCE refuses any request that went through a proxy, so that a reverse proxy on the instance cannot
	// hand the metadata (and the service account's tokens) to whoever calls it.
	if r.Header.Values("X-Forwarded-For") != nil {
		writeError(w, http.StatusForbidden, "Your client does not have permission to get URL <code>"+html.EscapeString(r.URL.Path)+"</code> from this server. Request had X-Forwarded-For header.")
		return
	}
	if r.Header.Get("Metadata-Flavor") != "Google" {
		writeError(w, http.StatusForbidden, "Your client does not have permission to get URL <code>"+html.EscapeString(r.URL.Path)+"</code> from this server. Missing Metadata-Flavor:Google header.")
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeError(w, http.StatusMethodNotAllowed, "The request method <code>"+html.EscapeString(r.Method)+"</code> is inappropriate for the URL <code>"+html.EscapeString(r.URL.Path)+"</code>.")
		return
	}
	path, ok := strings.CutPrefix(r.URL.Path, Prefix)
	if !ok {
		notFound(w, r)
		return
	}

	if faulty {
		if fault.Delay > 0 {
			t := time.NewTimer(fault.Delay)
			defer t.Stop()
			select {
			case <-t.C:
			case <-r.Context().Done():
				return
			}
		}
		if fault.Status != 0 || fault.Body != nil {
			switch {
			case fault.Body != nil:
				status := fault.Status
				if status == 0 {
					status = http.StatusOK
				}
				w.Header().Set("Content-Type", "application/text")
				w.WriteHeader(status)
				_, _ = w.Write(fault.Body)
			case fault.Status == http.StatusNotFound:
				notFound(w, r)
			default:
				writeError(w, fault.Status, html.EscapeString(http.StatusText(fault.Status)))
			}
			return
		}
	}

	if isToken(path, inst) {
		h.serveToken(w, inst)
		return
	}
	node, isDir := lookup(tree(inst), path)
	switch {
	case node == nil:
		notFound(w, r)
	case isDir && !strings.HasSuffix(path, "/") && path != "":
		// GCE sends a directory named without its slash to its listing.
		u := *r.URL
		u.Path += "/"
		http.Redirect(w, r, u.String(), http.StatusMovedPermanently)
	case isDir:
		serveDir(w, r, node.(*dir))
	default:
		serveValue(w, r, node)
	}
}

// isToken reports whether path asks for the default service account's access token, by its alias or its
// email; GCE takes options (scopes=…) in the query, which the server ignores.
func isToken(path string, inst Instance) bool {
	account, ok := strings.CutPrefix(path, "instance/service-accounts/")
	if !ok {
		return false
	}
	account, ok = strings.CutSuffix(account, "/token")
	return ok && (account == "default" || account == serviceAccount(inst))
}

func (h *Handler) serveToken(w http.ResponseWriter, inst Instance) {
	h.mu.Lock()
	h.tokenRequests++
	h.mu.Unlock()
	lifetime := inst.TokenLifetime
	if lifetime == 0 {
		lifetime = 3599 * time.Second
	}
	token := inst.Token
	if token == "" {
		token = "ya29.gcemetadatatest"
	}
	writeJSON(w, map[string]any{
		"access_token": token,
		"expires_in":   int64(lifetime / time.Second),
		"token_type":   "Bearer",
	})
}

func serviceAccount(inst Instance) string {
	if inst.ServiceAccount != "" {
		return inst.ServiceAccount
	}
	return strconv.FormatUint(inst.ProjectNumber, 10) + "-compute@developer.gserviceaccount.com"
}

// dir is a metadata directory. Its entries are dirs or values: a string, a json.Number (a number in
// JSON, GCE's ids) or a []string (lines in text, an array in JSON).
type dir struct {
	entries map[string]any
	// named: the entries' names are data (attribute keys, service accounts), kept as they are in recursive
	// JSON, where GCE writes its own dashed names in camelCase.
	named bool
	// array: the entries are "0", "1", … (network interfaces), an array in recursive JSON.
	array bool
}

func tree(inst Instance) *dir {
	num := strconv.FormatUint(inst.ProjectNumber, 10)
	attributes := &dir{entries: map[string]any{}, named: true}
	if inst.NodeConfig != nil {
		attributes.entries[NodeConfigKey] = string(inst.NodeConfig)
	}
	email := serviceAccount(inst)
	account := func(alias string) *dir {
		return &dir{entries: map[string]any{
			"aliases": []string{alias},
			"email":   email,
			"scopes":  []string{"https://www.googleapis.com/auth/cloud-platform"},
		}}
	}
	instance := map[string]any{
		"id":         json.Number(strconv.FormatUint(inst.ID, 10)),
		"name":       inst.Name,
		"hostname":   inst.Name + "." + inst.Zone + ".c." + inst.ProjectID + ".internal",
		"zone":       "projects/" + num + "/zones/" + inst.Zone,
		"attributes": attributes,
		"network-interfaces": &dir{array: true, entries: map[string]any{
			"0": &dir{entries: map[string]any{"ip": inst.IP, "network": "projects/" + num + "/networks/" + inst.Network}},
		}},
		"service-accounts": &dir{named: true, entries: map[string]any{"default": account("default"), email: account("default")}},
	}
	if inst.Image != "" {
		instance["image"] = inst.Image
	}
	return &dir{entries: map[string]any{
		"instance": &dir{entries: instance},
		"project": &dir{entries: map[string]any{
			"project-id":         inst.ProjectID,
			"numeric-project-id": json.Number(num),
			"attributes":         &dir{entries: map[string]any{}, named: true},
		}},
	}}
}

// lookup finds path ("instance/id", "instance/" or "" for the root) in root.
func lookup(root *dir, path string) (node any, isDir bool) {
	node = root
	for part := range strings.SplitSeq(strings.TrimSuffix(path, "/"), "/") {
		if part == "" && path == "" {
			break
		}
		d, ok := node.(*dir)
		if !ok {
			return nil, false
		}
		if node, ok = d.entries[part]; !ok {
			return nil, false
		}
	}
	_, isDir = node.(*dir)
	if !isDir && strings.HasSuffix(path, "/") {
		return nil, false
	}
	return node, isDir
}

func serveValue(w http.ResponseWriter, r *http.Request, v any) {
	switch alt(r) {
	case "json":
		writeJSON(w, v)
	case "text":
		if lines, ok := v.([]string); ok {
			writeText(w, strings.Join(lines, "\n")+"\n")
		} else {
			writeText(w, fmt.Sprint(v))
		}
	default:
		writeError(w, http.StatusBadRequest, "Invalid alt parameter.")
	}
}

// serveDir lists d's entries, directories with a trailing slash, or with ?recursive=true gives d as JSON.
func serveDir(w http.ResponseWriter, r *http.Request, d *dir) {
	recursive := r.URL.Query().Get("recursive") == "true"
	format := alt(r)
	if recursive && r.URL.Query().Get("alt") == "" {
		format = "json"
	}
	switch {
	case format == "json" && recursive:
		writeJSON(w, d.json())
	case format == "json":
		writeJSON(w, d.names())
	case format == "text" && !recursive:
		writeText(w, strings.Join(d.names(), "\n")+"\n")
	default:
		writeError(w, http.StatusBadRequest, "Invalid alt parameter for a recursive listing.")
	}
}

func alt(r *http.Request) string {
	if a := r.URL.Query().Get("alt"); a != "" {
		return a
	}
	return "text"
}

func (d *dir) names() []string {
	names := make([]string, 0, len(d.entries))
	for name, e := range d.entries {
		if _, ok := e.(*dir); ok {
			name += "/"
		}
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

func (d *dir) json() any {
	conv := func(e any) any {
		if sub, ok := e.(*dir); ok {
			return sub.json()
		}
		return e
	}
	if d.array {
		arr := make([]any, len(d.entries))
		for i := range arr {
			arr[i] = conv(d.entries[strconv.Itoa(i)])
		}
		return arr
	}
	obj := make(map[string]any, len(d.entries))
	for _, name := range slices.Sorted(maps.Keys(d.entries)) {
		key := name
		if !d.named {
			key = camelCase(name)
		}
		obj[key] = conv(d.entries[name])
	}
	return obj
}

// camelCase is GCE's key in recursive JSON for one of its dashed names: numeric-project-id → numericProjectId.
func camelCase(name string) string {
	parts := strings.Split(name, "-")
	for i := 1; i < len(parts); i++ {
		if parts[i] != "" {
			parts[i] = strings.ToUpper(parts[i][:1]) + parts[i][1:]
		}
	}
	return strings.Join(parts, "")
}

func writeText(w http.ResponseWriter, s string) {
	w.Header().Set("Content-Type", "application/text")
	_, _ = w.Write([]byte(s))
}

func writeJSON(w http.ResponseWriter, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(w, http.StatusInternalServerError, html.EscapeString(err.Error()))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

func notFound(w http.ResponseWriter, r *http.Request) {
	writeError(w, http.StatusNotFound, "The requested URL <code>"+html.EscapeString(r.URL.Path)+"</code> was not found on this server.")
}

// writeError answers with Google's error page, message being HTML. (Google's page also carries a style
// sheet and its logo, left out here.)
func writeError(w http.ResponseWriter, code int, message string) {
	w.Header().Set("Content-Type", "text/html; charset=UTF-8")
	w.WriteHeader(code)
	fmt.Fprintf(w, `<!DOCTYPE html>
<html lang=en>
  <meta charset=utf-8>
  <meta name=viewport content="initial-scale=1, minimum-scale=1, width=device-width">
  <title>Error %[1]d (%[2]s)!!1</title>
  <style>*{margin:0;padding:0}html,code{font:15px/22px arial,sans-serif}</style>
  <p><b>%[1]d.</b> <ins>That’s an error.</ins>
  <p>%[3]s  <ins>That’s all we know.</ins>
`, code, html.EscapeString(http.StatusText(code)), message)
}

// Server is a Handler served on loopback for one test.
type Server struct {
	*Handler
	// URL is http://127.0.0.1:<port>, a client's endpoint; Host is 127.0.0.1:<port>, as GCE_METADATA_HOST
	// takes it.
	URL, Host string
}

// New serves inst on loopback until the test ends.
func New(t testing.TB, inst Instance) *Server {
	t.Helper()
	h := NewHandler(inst)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &Server{Handler: h, URL: srv.URL, Host: srv.Listener.Addr().String()}
}

// Example is an instance in the shape GCE gives one, for tests that need any.
func Example() Instance {
	return Instance{
		ID:            4520818434431224105,
		Name:          "berth-workers-7x2k",
		Zone:          "europe-west1-b",
		ProjectID:     "berth-prod",
		ProjectNumber: 731029385467,
		IP:            "10.132.0.7",
		Network:       "berth",
		Image:         "projects/berth-prod/global/images/berth-node-1-2-0",
	}
}

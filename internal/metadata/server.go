package metadata

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/netip"
	"net/url"
	"sync/atomic"
)

// API paths of the metadata service.
const (
	PathSelf      = "/v1/self"
	PathInstances = "/v1/instances"
)

// Server serves a Document over HTTP. It is an http.Handler; the caller owns
// the listener, so labs and tests choose their own addresses.
type Server struct {
	state  atomic.Pointer[serverState]
	logger *slog.Logger
}

// serverState is an immutable snapshot: a document and its address index.
type serverState struct {
	doc    *Document
	byAddr map[netip.Addr]*Instance
}

// NewServer returns a server for doc, which should have passed Validate (or
// come from ParseDocument). The server keeps its own copy. A nil logger
// discards.
func NewServer(doc *Document, logger *slog.Logger) *Server {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{logger: logger}
	s.Replace(doc)
	return s
}

// Replace swaps the served document at once; requests in flight finish with
// the old one. Labs use it to add nodes while the service runs.
func (s *Server) Replace(doc *Document) {
	if doc == nil {
		doc = &Document{}
	}
	st := &serverState{doc: doc.clone(), byAddr: make(map[netip.Addr]*Instance)}
	for i := range st.doc.Instances {
		inst := &st.doc.Instances[i]
		for _, a := range inst.Addresses {
			if _, dup := st.byAddr[a]; !dup {
				st.byAddr[a] = inst
			}
		}
	}
	s.state.Store(st)
	s.logger.Info("metadata document loaded", "instances", len(st.doc.Instances))
}

type errorBody struct {
	Error string `json:"error"`
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != PathSelf && r.URL.Path != PathInstances {
		writeJSON(w, http.StatusNotFound, errorBody{Error: "no such path"})
		return
	}
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		writeJSON(w, http.StatusMethodNotAllowed, errorBody{Error: "only GET is allowed"})
		return
	}
	st := s.state.Load()
	if r.URL.Path == PathSelf {
		s.serveSelf(w, r, st)
		return
	}
	s.serveInstances(w, r, st)
}

func (s *Server) serveSelf(w http.ResponseWriter, r *http.Request, st *serverState) {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		s.logger.Error("metadata request with unparsable remote address", "remote", r.RemoteAddr, "error", err)
		writeJSON(w, http.StatusInternalServerError, errorBody{Error: "cannot determine the caller's address"})
		return
	}
	// A dual-stack listener reports IPv4 callers as ::ffff:a.b.c.d; records hold the plain form.
	addr := ap.Addr().Unmap().WithZone("")
	inst, ok := st.byAddr[addr]
	if !ok {
		s.logger.Warn("metadata self lookup for unknown address", "address", addr)
		writeJSON(w, http.StatusNotFound, errorBody{Error: "no instance has address " + addr.String()})
		return
	}
	s.logger.Info("metadata self served", "address", addr, "instance", inst.Name, "role", inst.Role)
	writeJSON(w, http.StatusOK, Self{Instance: *inst, UserData: st.doc.UserData})
}

func (s *Server) serveInstances(w http.ResponseWriter, r *http.Request, st *serverState) {
	q := r.URL.Query()
	for k := range q {
		if k != "address" && k != "role" {
			writeJSON(w, http.StatusBadRequest, errorBody{Error: "unknown query parameter " + k})
			return
		}
	}
	if q.Has("address") && q.Has("role") {
		writeJSON(w, http.StatusBadRequest, errorBody{Error: "ask by address or by role, not both"})
		return
	}
	if !q.Has("address") {
		s.serveList(w, q, st)
		return
	}
	if len(q["address"]) != 1 {
		writeJSON(w, http.StatusBadRequest, errorBody{Error: "address is given more than once"})
		return
	}
	addr, err := netip.ParseAddr(q.Get("address"))
	if err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody{Error: "address is not an IP address"})
		return
	}
	addr = addr.Unmap().WithZone("")
	inst, ok := st.byAddr[addr]
	if !ok {
		s.logger.Info("metadata lookup for unknown address", "address", addr, "remote", r.RemoteAddr)
		writeJSON(w, http.StatusNotFound, errorBody{Error: "no instance has address " + addr.String()})
		return
	}
	s.logger.Debug("metadata lookup served", "address", addr, "instance", inst.Name, "remote", r.RemoteAddr)
	writeJSON(w, http.StatusOK, inst)
}

// serveList answers the list of instances, or with ?role= those of one role: nodes ask for the control-plane
// instances at every join attempt, and a list of every node of a large cluster would cost each of them
// (and the service) in proportion to the cluster's size.
func (s *Server) serveList(w http.ResponseWriter, q url.Values, st *serverState) {
	instances := st.doc.Instances
	if q.Has("role") {
		if len(q["role"]) != 1 {
			writeJSON(w, http.StatusBadRequest, errorBody{Error: "role is given more than once"})
			return
		}
		role := Role(q.Get("role"))
		instances = nil
		for _, inst := range st.doc.Instances {
			if inst.Role == role {
				instances = append(instances, inst)
			}
		}
	}
	if instances == nil {
		instances = []Instance{}
	}
	writeJSON(w, http.StatusOK, instances)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		// Only our own types reach here, and they always marshal.
		status, body = http.StatusInternalServerError, []byte(`{"error":"encoding response"}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

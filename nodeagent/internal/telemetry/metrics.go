// Package telemetry is what an operator and a load balancer see of a running agent's servers: Prometheus
// metrics of the join service and the init server in a registry of the agent's own, and /healthz and /readyz,
// served on a plain-HTTP port apart from the servers they describe (docs/metrics.md).
//
// Every label value comes from a fixed list given at construction; a value outside it is counted as "other".
// Nothing a peer sends ever becomes a label, so a flood of odd requests cannot grow the series.
package telemetry

import (
	"log/slog"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/berthlabs/berth/internal/cloud/apicalls"
	"github.com/berthlabs/berth/internal/rpc"
	"github.com/berthlabs/berth/nodeagent/internal/kubecerts"
)

// Results of a join service exchange, as berth_join_exchange_duration_seconds labels them.
const (
	Issued  = "issued"
	Refused = "refused"
	Failed  = "error"
)

// other is the label value of anything outside a metric's fixed list.
const other = "other"

// APIs whose requests are counted.
const (
	APIKubernetes = "kubernetes"
	APIEC2        = "ec2"
	APICompute    = "compute"
)

// exchangeBuckets span a join exchange, from a rejoin answered from caches (a few milliseconds of swtpm time)
// to the 30 s bound of a slow vTPM's exchange.
var exchangeBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300}

// initBuckets span an init exchange, kubeadm init and the pod network included: refusals end in
// milliseconds, an init takes minutes, and berth_cluster's init_timeout (default 15 minutes) bounds it.
var initBuckets = []float64{.01, .1, 1, 10, 30, 60, 120, 180, 300, 450, 600, 900, 1200, 1800}

// bootBuckets span a boot step: reading the metadata takes milliseconds, reading a verified root tens of
// seconds, and becoming a member (a join, or waiting for an init) minutes, up to the hour a first node may
// wait for its operator.
var bootBuckets = []float64{.01, .1, 1, 5, 10, 30, 60, 120, 300, 600, 1200, 3600}

// sealBuckets span sealing the disk key to a policy's images: milliseconds on a swtpm, a few seconds on a
// slow vTPM for a policy of many images (one TPM session each), bounded by the TPM's own timeouts.
var sealBuckets = []float64{.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

// Outcomes of sealing the disk key and of renewing certificates, as berth_seals_total and
// berth_certificate_renewals_total label them.
const (
	ResultOK    = "ok"
	ResultError = "error"
)

// Labels are the fixed label values of the metrics.
type Labels struct {
	// JoinCalls are the join service's calls (join, rejoin, renew).
	JoinCalls []string
	// JoinRefusals are the reasons the join service refuses a node.
	JoinRefusals []string
	// JoinErrors are the kinds of exchange that ended without an answer (the service's own failure, a peer
	// gone).
	JoinErrors []string
	// InitResults are what an init exchange can come to.
	InitResults []string
	// BootSteps are the steps of a node's boot.
	BootSteps []string
	// Unlocks are the ways a node's state disk is opened (a new disk keyed, its TPM, a rejoin ticket, an
	// operator's recovery); LocalUnlockFallbacks the reasons a sealing node's TPM did not open it.
	Unlocks, LocalUnlockFallbacks []string
	// Build is the agent's, for berth_build_info.
	Build Build
}

// Build names an agent's build.
type Build struct {
	Version, KubernetesVersion string
}

// Metrics are the agent's metrics, in their own registry.
type Metrics struct {
	reg    *prometheus.Registry
	labels Labels

	issued       *prometheus.CounterVec
	refused      *prometheus.CounterVec
	errored      *prometheus.CounterVec
	joinDuration *prometheus.HistogramVec
	initTotal    *prometheus.CounterVec
	initDuration *prometheus.HistogramVec
	apiRequests  *prometheus.CounterVec

	policyLoaded  prometheus.Gauge
	policyImages  prometheus.Gauge
	policyLoads   prometheus.Counter
	policyLoadAt  prometheus.Gauge
	policyInfo    *prometheus.GaugeVec
	policyInfoMu  sync.Mutex
	connections   *admissionCollector
	apiReachGauge prometheus.Gauge

	bootStep         *prometheus.GaugeVec
	bootStepDuration *prometheus.HistogramVec
	bootFinished     prometheus.Gauge

	unlockDuration  *prometheus.HistogramVec
	unlockFallbacks *prometheus.CounterVec
	seals           *prometheus.CounterVec
	sealDuration    prometheus.Histogram
	sealLastOK      prometheus.Gauge
	certificates    *certificateCollector
	renewals        *prometheus.CounterVec
}

// New makes the metrics with every series of the fixed lists at zero, so that a rate over a fresh process
// is zero rather than absent.
func New(labels Labels) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry(), labels: labels}
	m.issued = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "berth_join_tickets_issued_total", Help: "Tickets (and renewed kubelet certificates) the join service sent, by call.",
	}, []string{"call"})
	m.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "berth_join_tickets_refused_total", Help: "Exchanges the join service refused after admitting the connection, by call and reason.",
	}, []string{"call", "reason"})
	m.errored = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "berth_join_exchange_errors_total", Help: "Exchanges that ended without ticket or refusal: the service's own failure (internal) or the stream's (stream: peer gone, timeout).",
	}, []string{"call", "kind"})
	m.joinDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "berth_join_exchange_duration_seconds", Help: "Time from a join service exchange's start to its answer, by call and result.",
		Buckets: exchangeBuckets,
	}, []string{"call", "result"})
	m.initTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "berth_init_exchanges_total", Help: "Init server exchanges by result.",
	}, []string{"result"})
	m.initDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "berth_init_exchange_duration_seconds", Help: "Init server exchanges' duration by result (kubeadm init included).",
		Buckets: initBuckets,
	}, []string{"result"})
	m.apiRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "berth_api_requests_total", Help: "Requests to the Kubernetes API and the cloud's API, each retry included, by API and outcome (ok, throttled, error).",
	}, []string{"api", "outcome"})
	m.policyLoaded = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "berth_join_policy_loaded", Help: "1 once the join service has loaded a join policy from its source.",
	})
	m.policyImages = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "berth_join_policy_images", Help: "Images the loaded join policy lists.",
	})
	m.policyLoads = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "berth_join_policy_loads_total", Help: "Join policies loaded since the start (each change counts).",
	})
	m.policyLoadAt = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "berth_join_policy_last_load_timestamp_seconds", Help: "When the current join policy was loaded, in Unix seconds.",
	})
	m.policyInfo = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "berth_join_policy_info", Help: "The loaded join policy's version: the first 12 hex digits of the SHA-256 of its canonical form; one series, the current one.",
	}, []string{"version"})
	m.connections = &admissionCollector{
		refused: prometheus.NewDesc("berth_join_connections_refused_total", "Connections the join service closed before their TLS handshake, by reason.", []string{"reason"}, nil),
		conns:   prometheus.NewDesc("berth_join_connections", "Connections of the join service: serving (holding one of the slots) or waiting (accepted, being admitted or waiting for a slot).", []string{"state"}, nil),
		slots:   prometheus.NewDesc("berth_join_connection_slots", "Connections the join service serves at once.", nil, nil),
	}
	m.apiReachGauge = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "berth_kubernetes_api_reachable", Help: "1 when the last periodic check of the Kubernetes API succeeded.",
	})
	m.bootStep = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "berth_boot_step", Help: "1 for the boot step the agent is in, 0 for the others; all 0 once the boot finished.",
	}, []string{"step"})
	m.bootStepDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "berth_boot_step_duration_seconds", Help: "How long each step of this boot took, by step.",
		Buckets: bootBuckets,
	}, []string{"step"})
	m.bootFinished = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "berth_boot_finished_timestamp_seconds", Help: "When this boot finished, in Unix seconds; 0 while it runs.",
	})
	m.unlockDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "berth_state_disk_unlock_duration_seconds", Help: "From the start of a boot's membership step until its state disk was open (a new disk: keyed, and the node joined or initialized), by how it was opened; its count is the number of such boots.",
		Buckets: bootBuckets,
	}, []string{"via"})
	m.unlockFallbacks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "berth_local_unlock_fallbacks_total", Help: "Boots of a sealing node whose TPM did not open its state disk, so that it asked for a rejoin ticket, by reason.",
	}, []string{"reason"})
	m.seals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "berth_seals_total", Help: "Seals of the disk key to the node's unlock policy, by result (ok, error).",
	}, []string{"result"})
	m.sealDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "berth_seal_duration_seconds", Help: "How long sealing the disk key took, failed seals included.",
		Buckets: sealBuckets,
	})
	m.sealLastOK = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "berth_seal_last_success_timestamp_seconds", Help: "When the disk key was last sealed, in Unix seconds; 0 if not in this process.",
	})
	m.certificates = &certificateCollector{
		desc: prometheus.NewDesc("berth_certificate_expiry_timestamp_seconds", "When the node's certificate expires (its NotAfter), in Unix seconds, by certificate; read from disk at each scrape.", []string{"certificate"}, nil),
		log:  slog.New(slog.DiscardHandler),
	}
	m.renewals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "berth_certificate_renewals_total", Help: "Renewals of this control-plane node's kubeadm certificates, by result (ok, error).",
	}, []string{"result"})
	buildInfo := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "berth_build_info", Help: "1, labelled with the agent's version, the Kubernetes version it was built with and Go's.",
		ConstLabels: prometheus.Labels{"version": labels.Build.Version, "kubernetes_version": labels.Build.KubernetesVersion, "go_version": runtime.Version()},
	})
	buildInfo.Set(1)
	m.reg.MustRegister(m.issued, m.refused, m.errored, m.joinDuration, m.initTotal, m.initDuration, m.apiRequests,
		m.policyLoaded, m.policyImages, m.policyLoads, m.policyLoadAt, m.policyInfo, m.connections, m.apiReachGauge,
		m.bootStep, m.bootStepDuration, m.bootFinished, buildInfo,
		m.unlockDuration, m.unlockFallbacks, m.seals, m.sealDuration, m.sealLastOK, m.certificates, m.renewals,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	for _, call := range withOther(labels.JoinCalls) {
		m.issued.WithLabelValues(call)
		for _, r := range withOther(labels.JoinRefusals) {
			m.refused.WithLabelValues(call, r)
		}
		for _, k := range withOther(labels.JoinErrors) {
			m.errored.WithLabelValues(call, k)
		}
		for _, r := range []string{Issued, Refused, Failed} {
			m.joinDuration.WithLabelValues(call, r)
		}
	}
	for _, r := range withOther(labels.InitResults) {
		m.initTotal.WithLabelValues(r)
		m.initDuration.WithLabelValues(r)
	}
	for _, step := range labels.BootSteps {
		m.bootStep.WithLabelValues(step)
		m.bootStepDuration.WithLabelValues(step)
	}
	for _, via := range withOther(labels.Unlocks) {
		m.unlockDuration.WithLabelValues(via)
	}
	for _, r := range withOther(labels.LocalUnlockFallbacks) {
		m.unlockFallbacks.WithLabelValues(r)
	}
	for _, r := range []string{ResultOK, ResultError} {
		m.seals.WithLabelValues(r)
		m.renewals.WithLabelValues(r)
	}
	for _, api := range withOther([]string{APIKubernetes, APIEC2, APICompute}) {
		for _, o := range []apicalls.Outcome{apicalls.OK, apicalls.Throttled, apicalls.Error} {
			m.apiRequests.WithLabelValues(api, string(o))
		}
	}
	return m
}

// Registry is where the metrics are, for the metrics endpoint and tests.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// TicketIssued counts a ticket of call sent, after took.
func (m *Metrics) TicketIssued(call string, took time.Duration) {
	call = pick(call, m.labels.JoinCalls)
	m.issued.WithLabelValues(call).Inc()
	m.joinDuration.WithLabelValues(call, Issued).Observe(took.Seconds())
}

// TicketRefused counts an exchange of call refused for reason, after took.
func (m *Metrics) TicketRefused(call, reason string, took time.Duration) {
	call = pick(call, m.labels.JoinCalls)
	m.refused.WithLabelValues(call, pick(reason, m.labels.JoinRefusals)).Inc()
	m.joinDuration.WithLabelValues(call, Refused).Observe(took.Seconds())
}

// ExchangeFailed counts an exchange of call that ended without ticket or refusal, by kind, after took.
func (m *Metrics) ExchangeFailed(call, kind string, took time.Duration) {
	call = pick(call, m.labels.JoinCalls)
	m.errored.WithLabelValues(call, pick(kind, m.labels.JoinErrors)).Inc()
	m.joinDuration.WithLabelValues(call, Failed).Observe(took.Seconds())
}

// InitExchange counts one init server exchange by its result.
func (m *Metrics) InitExchange(result string, took time.Duration) {
	result = pick(result, m.labels.InitResults)
	m.initTotal.WithLabelValues(result).Inc()
	m.initDuration.WithLabelValues(result).Observe(took.Seconds())
}

// BootStepStarted shows step as the one the boot is in. Like BootStepDone and BootFinished, it does nothing
// on nil metrics (an agent without metricsListen).
func (m *Metrics) BootStepStarted(step string) {
	if m == nil {
		return
	}
	step = pick(step, m.labels.BootSteps)
	for _, s := range m.labels.BootSteps {
		m.bootStep.WithLabelValues(s).Set(0)
	}
	m.bootStep.WithLabelValues(step).Set(1)
}

// BootStepDone records that step took took.
func (m *Metrics) BootStepDone(step string, took time.Duration) {
	if m == nil {
		return
	}
	step = pick(step, m.labels.BootSteps)
	m.bootStepDuration.WithLabelValues(step).Observe(took.Seconds())
	m.bootStep.WithLabelValues(step).Set(0)
}

// BootFinished records that the boot finished at at.
func (m *Metrics) BootFinished(at time.Time) {
	if m == nil {
		return
	}
	m.bootFinished.Set(float64(at.UnixNano()) / 1e9)
}

// StateDiskUnlocked records that the state disk was opened via one of the Unlocks, took after the start of
// the boot's membership step.
func (m *Metrics) StateDiskUnlocked(via string, took time.Duration) {
	if m == nil {
		return
	}
	m.unlockDuration.WithLabelValues(pick(via, m.labels.Unlocks)).Observe(took.Seconds())
}

// LocalUnlockFellBack counts a boot whose TPM did not open the state disk, for reason.
func (m *Metrics) LocalUnlockFellBack(reason string) {
	if m == nil {
		return
	}
	m.unlockFallbacks.WithLabelValues(pick(reason, m.labels.LocalUnlockFallbacks)).Inc()
}

// Sealed records a seal of the disk key that ended at at after took, with err (nil when it succeeded).
func (m *Metrics) Sealed(err error, took time.Duration, at time.Time) {
	if m == nil {
		return
	}
	m.sealDuration.Observe(took.Seconds())
	if err != nil {
		m.seals.WithLabelValues(ResultError).Inc()
		return
	}
	m.seals.WithLabelValues(ResultOK).Inc()
	m.sealLastOK.Set(float64(at.UnixNano()) / 1e9)
}

// CertificatesRenewed counts a renewal of the node's kubeadm certificates that ended with err (nil when it
// succeeded).
func (m *Metrics) CertificatesRenewed(err error) {
	if m == nil {
		return
	}
	result := ResultOK
	if err != nil {
		result = ResultError
	}
	m.renewals.WithLabelValues(result).Inc()
}

// WatchCertificates makes files the certificates whose expiry the metrics show, read at each scrape; an
// unreadable one is logged to log once.
func (m *Metrics) WatchCertificates(files []kubecerts.File, log *slog.Logger) {
	m.certificates.mu.Lock()
	defer m.certificates.mu.Unlock()
	m.certificates.files, m.certificates.log = slices.Clone(files), log
}

// Calls counts the requests to api (APIKubernetes, APIEC2, APICompute) by outcome.
func (m *Metrics) Calls(api string) apicalls.Counter {
	return apiCounter{m: m.apiRequests, api: pick(api, []string{APIKubernetes, APIEC2, APICompute})}
}

type apiCounter struct {
	m   *prometheus.CounterVec
	api string
}

func (c apiCounter) Count(o apicalls.Outcome) {
	switch o {
	case apicalls.OK, apicalls.Throttled:
	default:
		o = apicalls.Error
	}
	c.m.WithLabelValues(c.api, string(o)).Inc()
}

// PolicyLoaded records the join policy a source loaded: its number of images and its version.
func (m *Metrics) PolicyLoaded(images int, version string, at time.Time) {
	m.policyLoaded.Set(1)
	m.policyImages.Set(float64(images))
	m.policyLoads.Inc()
	m.policyLoadAt.Set(float64(at.UnixNano()) / 1e9)
	m.policyInfoMu.Lock()
	defer m.policyInfoMu.Unlock()
	// One series at a time: the old version's would otherwise stay at 1 beside the new one's.
	m.policyInfo.Reset()
	m.policyInfo.WithLabelValues(version).Set(1)
}

// Admission is the join service's listener, as its metrics read it at each scrape.
type Admission interface {
	// Refused is how many connections were refused before their handshake since the start, by reason.
	Refused() map[string]int
	// Connections are the connections being served and those waiting, and how many may be served at once.
	Connections() (serving, waiting, slots int)
}

// WatchAdmission makes the join service's listener l the source of the connection metrics.
func (m *Metrics) WatchAdmission(l Admission) {
	m.connections.set(l)
}

// admissionRefusals are the listener's refusal reasons: fixed by package rpc.
var admissionRefusals = []string{rpc.RefusedAddressLimit, rpc.RefusedNotAdmitted, rpc.RefusedAdmitFailed, rpc.RefusedBadAddress, rpc.RefusedNoSlot}

// admissionCollector reads the listener at each scrape: its counts are kept by the listener, which the
// admission path updates anyway, so serving metrics costs the admission nothing more.
type admissionCollector struct {
	refused, conns, slots *prometheus.Desc

	mu sync.Mutex
	l  Admission
}

func (c *admissionCollector) set(l Admission) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.l = l
}

func (c *admissionCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.refused
	ch <- c.conns
	ch <- c.slots
}

func (c *admissionCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	l := c.l
	c.mu.Unlock()
	var refused map[string]int
	var serving, waiting, slots int
	if l != nil {
		refused = l.Refused()
		serving, waiting, slots = l.Connections()
	}
	others := 0
	for reason, n := range refused {
		if !slices.Contains(admissionRefusals, reason) {
			others += n
		}
	}
	for _, reason := range admissionRefusals {
		ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(refused[reason]), reason)
	}
	ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(others), other)
	ch <- prometheus.MustNewConstMetric(c.conns, prometheus.GaugeValue, float64(serving), "serving")
	ch <- prometheus.MustNewConstMetric(c.conns, prometheus.GaugeValue, float64(waiting), "waiting")
	ch <- prometheus.MustNewConstMetric(c.slots, prometheus.GaugeValue, float64(slots))
}

// pick is v if the list has it, else "other".
func pick(v string, list []string) string {
	if slices.Contains(list, v) {
		return v
	}
	return other
}

func withOther(list []string) []string {
	return append(slices.Clip(list), other)
}

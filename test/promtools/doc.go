// Package promtools pins the Prometheus whose promtool checks docs/alerts.yaml, runs its unit tests and parses
// the Grafana dashboard's queries, built from its module by scripts/build-promtool.sh. It is a module of its
// own so that Prometheus's dependencies (its service discovery pulls in every cloud's SDK) stay out of the
// product's go.mod.
package promtools

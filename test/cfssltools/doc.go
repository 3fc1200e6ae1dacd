// Package cfssltools pins the CFSSL that Berth's join-service tests run as a remote signer: `cfssl serve`
// with an authenticated signing profile and a sqlite certificate database, built from its module by
// scripts/build-cfssl.sh. It is a module of its own so that CFSSL's dependencies stay out of the product's
// go.mod. v1.6.5 is the newest release that builds with the Go the project pins; later ones need a newer Go.
package cfssltools

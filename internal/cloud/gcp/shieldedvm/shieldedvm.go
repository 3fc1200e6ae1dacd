// Package shieldedvm decides whether a TPM is the vTPM Compute Engine attached to a given Shielded VM
// instance.
//
// Trust model. Google signs the endorsement key certificate of every Shielded VM vTPM with one of its
// published EK CAs (roots/), and the newer certificates (issued by "EK/AK CA Intermediate") also carry,
// in an extension of Google's, the project, zone, id and name of the instance the vTPM belongs to. A
// node's EK is trusted for an instance when
//
//  1. its certificate chains to Google's EK roots (so the key is a Google vTPM's, not a software TPM's),
//  2. the instance the certificate names, where it names one, is that instance, and
//  3. where a Compute API source is configured, the EK the API reports for the instance
//     (instances.getShieldedInstanceIdentity) is the node's.
//
// The join service uses all three (it calls the Compute API anyway); Terraform's first node uses the
// first two, so the provider needs no Google credentials. A certificate without the instance extension
// (older vTPMs) is bound to its instance by check 3 alone, and refused where there is no API to ask.
// That the node holds the EK's private key is proved elsewhere, by credential activation.
package shieldedvm

import (
	"context"
	"crypto/x509"
	"crypto/x509/pkix"
	"embed"
	"encoding/asn1"
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"strconv"
	"time"

	"github.com/berthlabs/berth/internal/attest"
)

//go:embed roots/*.der
var rootFiles embed.FS

// The CA files of roots/: the two self-signed roots, and the intermediates that EK certificates chain through.
var (
	googleRootFiles         = []string{"ek_ak_ca_root.der", "tpm_ek_v1_cloud_host_root.der"}
	googleIntermediateFiles = []string{"ek_ak_ca_intermediate_v3.der", "tpm_ek_v1_cloud_host_intermediate_2.der", "tpm_ek_v1_cloud_host_intermediate_3.der"}
)

// GoogleCAs returns Google's vTPM EK roots and intermediates.
func GoogleCAs() (roots, intermediates *x509.CertPool, err error) {
	if roots, err = pool(googleRootFiles); err != nil {
		return nil, nil, err
	}
	if intermediates, err = pool(googleIntermediateFiles); err != nil {
		return nil, nil, err
	}
	return roots, intermediates, nil
}

func pool(names []string) (*x509.CertPool, error) {
	p := x509.NewCertPool()
	for _, name := range names {
		der, err := rootFiles.ReadFile("roots/" + name)
		if err != nil {
			return nil, fmt.Errorf("Google's vTPM CA %s: %w", name, err)
		}
		cert, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, fmt.Errorf("Google's vTPM CA %s: %w", name, err)
		}
		p.AddCert(cert)
	}
	return p, nil
}

// Instance names one Compute Engine instance the way the join service's records do:
// "projects/<project id>/zones/<zone>/instances/<id or name>".
type Instance struct {
	Project, Zone string
	// Instance is the numeric id or the name.
	Instance string
}

func (i Instance) String() string {
	return "projects/" + i.Project + "/zones/" + i.Zone + "/instances/" + i.Instance
}

// instancePath accepts project ids (6–30 characters, optionally with a "domain:" prefix of legacy
// projects), zone names and instance names or ids as Compute Engine forms them.
var instancePath = regexp.MustCompile(`^projects/((?:[a-z0-9.-]+:)?[a-z][-a-z0-9]{4,28}[a-z0-9])/zones/([a-z]+-[a-z]+[0-9]+-[a-z])/instances/([a-z](?:[-a-z0-9]{0,61}[a-z0-9])?|[0-9]{1,20})$`)

// ParseInstance parses "projects/<project id>/zones/<zone>/instances/<id or name>".
func ParseInstance(s string) (Instance, error) {
	m := instancePath.FindStringSubmatch(s)
	if m == nil {
		return Instance{}, fmt.Errorf("%q is not projects/<project id>/zones/<zone>/instances/<id or name>", s)
	}
	if m[3][0] >= '0' && m[3][0] <= '9' {
		if _, err := strconv.ParseUint(m[3], 10, 64); err != nil {
			return Instance{}, fmt.Errorf("%q: instance id %s is not an unsigned 64-bit number", s, m[3])
		}
	}
	return Instance{Project: m[1], Zone: m[2], Instance: m[3]}, nil
}

// InstanceInfo is what Google's extension in a vTPM's EK certificate says about the instance.
type InstanceInfo struct {
	Zone          string
	ProjectNumber uint64
	ProjectID     string
	InstanceID    uint64
	InstanceName  string
}

// oidInstanceInfo is Google's extension "cloud compute instance identifier" of vTPM certificates.
var oidInstanceInfo = asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1, 11129, 2, 1, 21}

// instanceInfoASN1 is the extension's DER form: SEQUENCE { zone UTF8String, projectNumber INTEGER,
// projectId UTF8String, instanceId INTEGER, instanceName UTF8String, securityProperties [0] ... OPTIONAL }.
type instanceInfoASN1 struct {
	Zone          string `asn1:"utf8"`
	ProjectNumber *big.Int
	ProjectID     string `asn1:"utf8"`
	// InstanceID is a big.Int because Compute Engine's ids are unsigned 64-bit numbers: DER writes those
	// above 2^63 in nine bytes, which an int64 does not take.
	InstanceID   *big.Int
	InstanceName string        `asn1:"utf8"`
	Security     asn1.RawValue `asn1:"optional"`
}

// InstanceInfoOf returns the instance that cert names, and false when it has no such extension.
func InstanceInfoOf(cert *x509.Certificate) (InstanceInfo, bool, error) {
	for _, ext := range cert.Extensions {
		if !ext.Id.Equal(oidInstanceInfo) {
			continue
		}
		var v instanceInfoASN1
		rest, err := asn1.Unmarshal(ext.Value, &v)
		if err != nil {
			return InstanceInfo{}, false, fmt.Errorf("the certificate's instance extension is malformed: %w", err)
		}
		if len(rest) > 0 {
			return InstanceInfo{}, false, errors.New("the certificate's instance extension has trailing data")
		}
		if !isUint64(v.ProjectNumber) || !isUint64(v.InstanceID) {
			return InstanceInfo{}, false, fmt.Errorf("the certificate's project number %v or instance id %v is not an unsigned 64-bit number", v.ProjectNumber, v.InstanceID)
		}
		return InstanceInfo{Zone: v.Zone, ProjectNumber: v.ProjectNumber.Uint64(), ProjectID: v.ProjectID,
			InstanceID: v.InstanceID.Uint64(), InstanceName: v.InstanceName}, true, nil
	}
	return InstanceInfo{}, false, nil
}

func isUint64(n *big.Int) bool { return n.Sign() >= 0 && n.IsUint64() }

// Extension is i as Google's extension of vTPM certificates, for CAs of the same shape (tests, labs).
func (i InstanceInfo) Extension() (pkix.Extension, error) {
	der, err := asn1.Marshal(instanceInfoASN1{Zone: i.Zone, ProjectNumber: new(big.Int).SetUint64(i.ProjectNumber),
		ProjectID: i.ProjectID, InstanceID: new(big.Int).SetUint64(i.InstanceID), InstanceName: i.InstanceName})
	if err != nil {
		return pkix.Extension{}, fmt.Errorf("encoding the instance extension: %w", err)
	}
	return pkix.Extension{Id: oidInstanceInfo, Value: der}, nil
}

// Trust is attest.EKTrust for Compute Engine Shielded VMs: see the package documentation.
type Trust struct {
	chain *attest.CertChain
	// identity is the Compute API's word on an instance's EK; nil where none is configured.
	identity attest.EKPublicSource
}

// NewTrust trusts vTPMs whose EK certificate chains to roots through intermediates (GoogleCAs, or a test
// CA of the same shape), bound to their instance by the certificate's instance extension and, when
// identity is not nil, by the EK the Compute API reports. now is the clock certificates are checked at
// (time.Now when nil).
func NewTrust(roots, intermediates *x509.CertPool, identity attest.EKPublicSource, now func() time.Time) *Trust {
	return &Trust{chain: attest.NewCertChain(roots, intermediates, now), identity: identity}
}

// TrustEK implements attest.EKTrust; instanceID is "projects/<project id>/zones/<zone>/instances/<id or name>".
func (t *Trust) TrustEK(ctx context.Context, ek attest.EK, instanceID string) error {
	inst, err := ParseInstance(instanceID)
	if err != nil {
		return fmt.Errorf("%w: Compute Engine vouches only for the vTPM of a known instance: %v", attest.ErrUntrusted, err)
	}
	if ek.Certificate == nil {
		return fmt.Errorf("%w: the TPM has no EK certificate, and the vTPM of a Shielded VM always has one", attest.ErrUntrusted)
	}
	if err := t.chain.TrustEK(ctx, ek, instanceID); err != nil {
		return err
	}
	info, named, err := InstanceInfoOf(ek.Certificate)
	if err != nil {
		return fmt.Errorf("%w: %v", attest.ErrUntrusted, err)
	}
	if named {
		if err := info.match(inst); err != nil {
			return fmt.Errorf("%w: the EK certificate is for %s, not %s: %v", attest.ErrUntrusted, info, inst, err)
		}
	}
	if t.identity == nil {
		if !named {
			return fmt.Errorf("%w: the EK certificate names no instance, and without the Compute API nothing binds it to %s", attest.ErrUntrusted, inst)
		}
		return nil
	}
	return attest.CloudEK{Cloud: "Compute Engine", Source: t.identity}.TrustEK(ctx, ek, instanceID)
}

func (i InstanceInfo) String() string {
	return fmt.Sprintf("projects/%s/zones/%s/instances/%s (id %d)", i.ProjectID, i.Zone, i.InstanceName, i.InstanceID)
}

// match compares the certificate's instance with inst, whose last part is an id or a name.
func (i InstanceInfo) match(inst Instance) error {
	if i.ProjectID != inst.Project {
		return fmt.Errorf("project %q", i.ProjectID)
	}
	if i.Zone != inst.Zone {
		return fmt.Errorf("zone %q", i.Zone)
	}
	if id, err := strconv.ParseUint(inst.Instance, 10, 64); err == nil {
		if id != i.InstanceID {
			return fmt.Errorf("instance id %d", i.InstanceID)
		}
		return nil
	}
	if i.InstanceName != inst.Instance {
		return fmt.Errorf("instance name %q", i.InstanceName)
	}
	return nil
}

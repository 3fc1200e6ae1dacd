// Package diskrecord names the join service's record of a machine it admitted: a ConfigMap in kube-system
// per state disk, which the join service writes (nodeagent/internal/joinservice) and the Terraform provider's
// berth_cluster_health reads to tell a machine that was admitted from one that never was. Both sides take the
// names from here, so that neither can change the format alone.
package diskrecord

// Prefix starts the name of a disk's record, berth-disk-<disk UUID>.
const Prefix = "berth-disk-"

// InstanceNameAnnotation holds the name of the machine the disk belongs to (its label holds only a hash, as a
// node name may be longer than a label value).
const InstanceNameAnnotation = "berth.dev/instance-name"

// ManagedByLabel and ManagedBy mark the records as the join service's.
const (
	ManagedByLabel = "app.kubernetes.io/managed-by"
	ManagedBy      = "berth"
)

// Selector lists the join service's records.
const Selector = ManagedByLabel + "=" + ManagedBy

// Name is the name of disk's record.
func Name(disk string) string { return Prefix + disk }

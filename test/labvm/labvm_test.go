package labvm

import "testing"

// TestBootStages: the stages of a boot in the order of time, the kubelet's last start, and the agent's
// messages only from the agent.
func TestBootStages(t *testing.T) {
	journal := `[   26.336348] vm-0 systemd[1]: Starting berth-images.service - Berth: the container images…
[   68.143321] vm-0 systemd[1]: Finished berth-images.service - Berth: the container images, imported into containerd.
[   68.218936] vm-0 systemd[1]: Started berth-agent.service - Berth node agent: state disk, TPM attestation, cluster join.
[   68.275854] vm-0 systemd[1]: Started kubelet.service - kubelet: the Kubernetes node agent.
[   71.820798] vm-0 berth-agent[293]: {"time":"2026-11-28T00:28:01.00800011Z","level":"INFO","msg":"boot started","state_disk":"/dev/vdb"}
[   74.164893] vm-0 berth-agent[293]: {"time":"2026-11-28T00:28:03.39265457Z","level":"INFO","msg":"luks volume formatted"}
[   75.447787] vm-0 berth-agent[293]: {"time":"2026-11-28T00:28:04.67403474Z","level":"INFO","msg":"join ticket received","node":"vm-0"}
[   83.680569] vm-0 systemd[1]: Started kubelet.service - kubelet: the Kubernetes node agent.
[   95.114508] vm-0 systemd[1]: Started kubelet.service - kubelet: the Kubernetes node agent.
[  100.9] vm-0 kubelet[600]: I1128 00:28:30 some kubelet line: "msg":"node joined" in a string`
	want := `  68.1s Finished berth-images.service - Berth: the container images, imported into containerd
  68.2s Started berth-agent.service - Berth node agent: state disk, TPM attestation, cluster join
  71.8s agent: boot started
  75.4s agent: join ticket received
  95.1s Started kubelet.service - kubelet: the Kubernetes node agent`
	if got := bootStages(journal); got != want {
		t.Errorf("bootStages:\n%s\nwant:\n%s", got, want)
	}
}

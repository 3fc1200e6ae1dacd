package ukiinstall

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	imagemanifest "github.com/berthlabs/berth/internal/manifest"
	"github.com/berthlabs/berth/internal/metadata"
	"github.com/berthlabs/berth/internal/policy"
	"github.com/berthlabs/berth/test/lab"
	"github.com/berthlabs/berth/test/labvm"
	"github.com/berthlabs/berth/test/packertest"
)

// localImage is what TestAccQEMUImage hands checkLocalImage: the Debian machine's directory, the stub, the
// agent and its configuration for the lab, the HCL objects of kubernetes_files and image_archives, and the
// qemu builder's image, which the join policy keeps admitting.
type localImage struct {
	vm, stub, agent, agentConfig string
	kubeFiles, archives          []string
	dir                          string
	qemuImage                    policy.Image
}

// checkLocalImage bakes examples/packer/node.pkr.hcl, the berth-uki builder's node image with a verified
// root, from the root of the same Debian machine (mounted read-only) for the lab, and boots it as a worker
// as TestAccQEMUImage boots the qemu builder's image: it attests with the predicted PCRs, joins with
// kubeadm, is Ready with kubeadm's and the kubelet's directories on its encrypted state disk, and a pod on
// it answers a pod on the lab's worker through a Service.
//
// Only with BERTH_LOCAL_NODE_JOIN=1: under TCG its build and boot add about four minutes, which a cold CI
// run has no room for (docs/lab.md); TestAccNodeImage checks the same template's image on every run.
func checkLocalImage(ctx context.Context, t *testing.T, l *lab.Lab, li localImage) {
	t.Helper()
	parts := packertest.Partitions(t, filepath.Join(li.vm, "disk.raw"))
	if len(parts) != 2 {
		t.Fatalf("debian-vm's disk has partitions %+v, want an ESP and the root", parts)
	}
	root := packertest.Mount(t, parts[1].Loop(t, true))
	output, manifestPath := filepath.Join(li.dir, "output-node"), filepath.Join(li.dir, "berth-image.json")
	if out, err := runPacker(t, "init", "node.pkr.hcl"); err != nil {
		t.Fatalf("packer init node.pkr.hcl: %v\n%s", err, out)
	}
	start := time.Now()
	out, err := runPacker(t, "build", "-var", "stub="+li.stub, "-var", "root_directory="+root, "-var", "agent_binary="+li.agent,
		"-var", "agent_config="+li.agentConfig, "-var", "kubernetes_files=["+strings.Join(li.kubeFiles, ", ")+"]",
		"-var", "image_archives=["+strings.Join(li.archives, ", ")+"]", "-var", "cni_bin_dir="+lab.CNIBinDir,
		"-var", "output_directory="+output, "-var", "manifest="+manifestPath, "node.pkr.hcl")
	if err != nil {
		t.Fatalf("packer build node.pkr.hcl: %v\n%s", err, out)
	}
	t.Logf("local image: packer build with berth-uki: %.0fs", time.Since(start).Seconds())
	data, err := os.ReadFile(manifestPath)
	if err != nil {
		t.Fatal(err)
	}
	m, err := imagemanifest.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	img, ok := m.Image("berth-node-local")
	if !ok {
		t.Fatalf("manifest images %+v, want berth-node-local", m.Images)
	}
	if err := l.SetPolicy(ctx, &policy.Policy{Images: []policy.Image{lab.LabImage(lab.ImageNames[0]), li.qemuImage, workerImage(t, img)}}); err != nil {
		t.Fatal(err)
	}

	start = time.Now()
	// Not 10.250.0.41 to .43: checkTamperedImages' machines take those next.
	node, err := labvm.Start(l, labvm.Machine{Name: "vm-local", Role: metadata.RoleWorker, Addr: netip.MustParseAddr("10.250.0.50"),
		Image: img.Name, Disk: filepath.Join(output, "berth.raw"), Dir: filepath.Join(li.dir, "vm"), Memory: 2048, CPUs: 2,
		SSHKey: filepath.Join(li.vm, "key")})
	if err != nil {
		t.Fatal(err)
	}
	defer node.PowerOff()
	waitCtx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	if _, err := node.WaitReady(waitCtx, ""); err != nil {
		t.Fatal(err)
	}
	t.Logf("local image: booted, attested, joined with kubeadm and Ready in %.0fs", time.Since(start).Seconds())
	logStages(ctx, t, node)
	checkStateDirs(ctx, t, node)
	start = time.Now()
	if err := l.ServeProbe(ctx, "on-local", []string{node.Name}); err != nil {
		t.Fatalf("%v\n%s", err, node.Diagnose(ctx))
	}
	reachVM(ctx, t, l, node, "on-local", "to-local")
	t.Logf("local image: a pod on it answered a pod on worker-0 through its Service in %.0fs", time.Since(start).Seconds())
}

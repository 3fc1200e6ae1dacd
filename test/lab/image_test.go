package lab

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/repotest"
)

func TestWriteDockerArchive(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "etcd")
	if err := os.WriteFile(bin, []byte("#!/bin/true\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	img := Image{Name: "registry.k8s.io/etcd:3.6.8-0", Entrypoint: []string{"/usr/local/bin/etcd"},
		Files: []ImageFile{{Path: "usr/local/bin/etcd", Src: bin, Mode: 0o755}}}
	var a, b bytes.Buffer
	if err := img.WriteDockerArchive(&a); err != nil {
		t.Fatal(err)
	}
	if err := img.WriteDockerArchive(&b); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("the same files gave two different archives")
	}
	entries := map[string][]byte{}
	tr := tar.NewReader(&a)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(tr)
		entries[h.Name] = data
	}
	var manifest []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(entries["manifest.json"], &manifest); err != nil || len(manifest) != 1 {
		t.Fatalf("manifest.json: %v %s", err, entries["manifest.json"])
	}
	m := manifest[0]
	if len(m.RepoTags) != 1 || m.RepoTags[0] != img.Name {
		t.Errorf("tags %v", m.RepoTags)
	}
	var config struct {
		RootFS struct {
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	if err := json.Unmarshal(entries[m.Config], &config); err != nil {
		t.Fatal(err)
	}
	layer := entries[m.Layers[0]]
	sum := sha256.Sum256(layer)
	if len(config.RootFS.DiffIDs) != 1 || config.RootFS.DiffIDs[0] != "sha256:"+hex.EncodeToString(sum[:]) {
		t.Errorf("diff_ids %v do not name the layer", config.RootFS.DiffIDs)
	}
	var names []string
	lr := tar.NewReader(bytes.NewReader(layer))
	for {
		h, err := lr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
	}
	want := []string{"usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/etcd"}
	if len(names) != len(want) {
		t.Fatalf("layer holds %v, want %v", names, want)
	}
	for i := range want {
		if names[i] != want[i] {
			t.Fatalf("layer holds %v, want %v", names, want)
		}
	}
}

// TestKubeadmImages pins the lab's image names to those its kubeadm asks for, and its CoreDNS build to the
// version kubeadm names: an image that drifts away sends kubeadm or the kubelet to a registry this machine
// cannot reach.
func TestKubeadmImages(t *testing.T) {
	kubeBin := repotest.BinDir(t, "BERTH_KUBE_BIN", "build-k8s.sh", "building Kubernetes from its modules")
	out, err := exec.Command(filepath.Join(kubeBin, "kubeadm"), "config", "images", "list", "--kubernetes-version", KubernetesVersion).Output()
	if err != nil {
		t.Fatalf("kubeadm config images list: %v", err)
	}
	got := strings.Fields(string(out))
	want := []string{pauseImage, etcdImage, kubeProxyImage, corednsImage}
	for _, c := range []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler"} {
		want = append(want, "registry.k8s.io/"+c+":"+KubernetesVersion)
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("kubeadm %s asks for\n%s\nthe lab makes\n%s", KubernetesVersion, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	version, err := exec.Command(filepath.Join(kubeBin, "coredns"), "-version").Output()
	if err != nil {
		t.Fatalf("coredns -version: %v", err)
	}
	_, tag, _ := strings.Cut(corednsImage, ":v")
	if !strings.Contains(string(version), "CoreDNS-"+tag+"\n") {
		t.Errorf("the CoreDNS built from test/corednstools/go.mod reports %q; kubeadm's image is %s", version, corednsImage)
	}
}

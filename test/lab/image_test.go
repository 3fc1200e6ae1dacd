package lab

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/podnetwork"
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
	for _, e := range readTar(t, a.Bytes()) {
		entries[e.Name] = e.body
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
	for _, e := range readTar(t, layer) {
		names = append(names, e.Name)
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

type tarEntry struct {
	*tar.Header
	body []byte
}

// readTar is every entry of the tar archive data, in order.
func readTar(t *testing.T, data []byte) []tarEntry {
	t.Helper()
	var out []tarEntry
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, tarEntry{h, body})
	}
}

// TestImageLayerEntries checks the layer's kinds of entry: a link, a file made from bytes, an empty
// directory with its mode, a set-uid file, and of two files at one path the first, which is how programs
// copied from the host share their libraries.
func TestImageLayerEntries(t *testing.T) {
	dir := t.TempDir()
	first, second := filepath.Join(dir, "first"), filepath.Join(dir, "second")
	for f, data := range map[string]string{first: "first", second: "second"} {
		if err := os.WriteFile(f, []byte(data), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	img := Image{Name: "berthlab.local/test:1", User: "1234", Cmd: []string{"sh"}, Files: []ImageFile{
		{Path: "bin/sh", Src: first, Mode: 0o755},
		{Path: "bin/sh", Link: "busybox"},
		{Path: "bin/ls", Link: "busybox"},
		{Path: "etc/passwd", Data: []byte("root:x:0:0::/:/bin/sh\n"), Mode: 0o644},
		{Path: "tmp", Mode: 0o1777},
		{Path: "usr/bin/nnp", Src: second, Mode: 0o4755},
	}}
	layer, err := img.layer()
	if err != nil {
		t.Fatal(err)
	}
	type entry struct {
		kind byte
		mode int64
		body string
	}
	got := map[string]entry{}
	for _, e := range readTar(t, layer) {
		if _, dup := got[e.Name]; dup {
			t.Errorf("%s is in the layer twice", e.Name)
		}
		body := string(e.body)
		if e.Typeflag == tar.TypeSymlink {
			body = e.Linkname
		}
		got[e.Name] = entry{e.Typeflag, e.Mode, body}
	}
	want := map[string]entry{
		"bin/":        {tar.TypeDir, 0o755, ""},
		"bin/sh":      {tar.TypeReg, 0o755, "first"},
		"bin/ls":      {tar.TypeSymlink, 0o777, "busybox"},
		"etc/":        {tar.TypeDir, 0o755, ""},
		"etc/passwd":  {tar.TypeReg, 0o644, "root:x:0:0::/:/bin/sh\n"},
		"tmp/":        {tar.TypeDir, 0o1777, ""},
		"usr/":        {tar.TypeDir, 0o755, ""},
		"usr/bin/":    {tar.TypeDir, 0o755, ""},
		"usr/bin/nnp": {tar.TypeReg, 0o4755, "second"},
	}
	if !maps.Equal(got, want) {
		t.Errorf("layer entries\n%v\nwant\n%v", got, want)
	}
	var a bytes.Buffer
	if err := img.WriteDockerArchive(&a); err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(a.Bytes(), []byte(`"User":"1234"`)) || !bytes.Contains(a.Bytes(), []byte(`"Cmd":["sh"]`)) {
		t.Error("the image configuration lacks its user or its command")
	}
}

// TestKubeadmImages pins what the lab makes to what its kubeadm asks for: an image of each repository
// buildImages makes, the Kubernetes components' of kubeadm's own release; its CoreDNS build to the version
// kubeadm of the repository's release names (an older release's kubeadm gets the same CoreDNS under its own
// tag), and its flanneld build to the version its image's name says. An image that drifts away sends kubeadm
// or the kubelet to a registry this machine cannot reach.
func TestKubeadmImages(t *testing.T) {
	kubeBin := repotest.BinDir(t, "BERTH_KUBE_BIN", "build-k8s.sh", "building Kubernetes from its modules")
	release, names, err := kubeadmImages(context.Background(), kubeBin)
	if err != nil {
		t.Fatal(err)
	}
	tags := map[string]string{}
	for _, name := range names {
		repo, tag, _ := strings.Cut(name, ":")
		tags[repo] = tag
		if strings.HasPrefix(repo, "registry.k8s.io/kube-") && tag != release {
			t.Errorf("kubeadm %s asks for %s, of another release", release, name)
		}
	}
	want := []string{pauseRepository, etcdRepository, coreDNSRepository, "registry.k8s.io/kube-proxy"}
	for _, c := range []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler"} {
		want = append(want, "registry.k8s.io/"+c)
	}
	slices.Sort(want)
	if got := slices.Sorted(maps.Keys(tags)); !slices.Equal(got, want) || len(names) != len(want) {
		t.Errorf("kubeadm %s asks for\n%s\nthe lab makes one image of each of\n%s", release, strings.Join(names, "\n"), strings.Join(want, "\n"))
	}
	if release == repotest.KubernetesVersion {
		version, err := exec.Command(filepath.Join(kubeBin, "coredns"), "-version").Output()
		if err != nil {
			t.Fatalf("coredns -version: %v", err)
		}
		if !strings.Contains(string(version), "CoreDNS-"+strings.TrimPrefix(tags[coreDNSRepository], "v")+"\n") {
			t.Errorf("the CoreDNS built from test/corednstools/go.mod reports %q; kubeadm %s asks for CoreDNS %s", version, release, tags[coreDNSRepository])
		}
	}
	// The lab's agents take the default Flannel image, so the lab's build must carry the default's name.
	if FlannelImage != podnetwork.DefaultFlannelImage {
		t.Errorf("the lab builds %s; the agent installs %s by default", FlannelImage, podnetwork.DefaultFlannelImage)
	}
	// flanneld prints its version on stderr.
	version, err := exec.Command(filepath.Join(kubeBin, "flanneld"), "--version").CombinedOutput()
	if err != nil {
		t.Fatalf("flanneld --version: %v\n%s", err, version)
	}
	_, tag, _ := strings.Cut(FlannelImage, ":")
	if string(version) != tag+"\n" {
		t.Errorf("the flanneld built from test/flanneltools/go.mod reports %q; the lab's image is %s", version, FlannelImage)
	}
}

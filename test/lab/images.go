package lab

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/berthlabs/berth/internal/kubeadm"
	"github.com/berthlabs/berth/test/gobuild"
)

// The lab's test workloads and pod network, the same at every Kubernetes release. The images kubeadm asks
// for are named by the release of the lab's kubeadm (kubeadmImages).
const (
	WorkloadImage = "berthlab.local/sleeper:v1"
	// ProbeImage serves and fetches over HTTP (test/lab/probe): the pod network's and the Services' test.
	ProbeImage = "berthlab.local/probe:v1"
	// FlannelImage is flanneld built from test/flanneltools/go.mod, under the name upstream's manifest
	// (kube-flannel.yml of the same version) gives its image, whose tag is the version flanneld reports.
	FlannelImage = "ghcr.io/flannel-io/flannel:v0.27.4"
	// FlannelCNIImage holds the lab's stand-in for Flannel's CNI plugin (test/lab/flannelcni), in place of
	// ghcr.io/flannel-io/flannel-cni-plugin, which the lab cannot build: its module is not served.
	FlannelCNIImage = "berthlab.local/flannel-cni-plugin:v1"
)

// Repositories of the images kubeadm asks for that are not named after a binary.
const (
	pauseRepository   = "registry.k8s.io/pause"
	etcdRepository    = "registry.k8s.io/etcd"
	coreDNSRepository = "registry.k8s.io/coredns/coredns"
)

// imageSet is where buildImages wrote the images of one Kubernetes release; lab.json keeps it for the
// processes that add nodes.
type imageSet struct {
	// Kubernetes is the release of the binaries they were made from, which kubeadm's image names follow.
	Kubernetes string `json:"kubernetes"`
	Pause      string `json:"pause"`
	// Every node loads these; control-plane nodes the ControlPlane images too.
	Node         []imageArchive `json:"node"`
	ControlPlane []imageArchive `json:"controlPlane"`
}

// imageArchive is an image's docker-archive tar.
type imageArchive struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// iptablesCommands are the names kube-proxy runs; the host's iptables is one program that acts on the
// name it is started as.
var iptablesCommands = []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"}

// imageSetFile, in an image directory, is the imageSet that buildImages made there: written last, so a
// directory with it is complete.
const imageSetFile = "images.json"

// imagesIn returns the images of kubeBin's release in a directory of dir named after it, made there first
// from kubeBin's binaries unless an earlier lab did: labs of two releases can share dir.
func imagesIn(ctx context.Context, kubeBin, dir string) (imageSet, error) {
	release, names, err := kubeadmImages(ctx, kubeBin)
	if err != nil {
		return imageSet{}, err
	}
	dir = filepath.Join(dir, release)
	var set imageSet
	data, err := os.ReadFile(filepath.Join(dir, imageSetFile))
	if err == nil {
		if err := json.Unmarshal(data, &set); err != nil {
			return imageSet{}, fmt.Errorf("reading %s: %w", filepath.Join(dir, imageSetFile), err)
		}
		return set, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return imageSet{}, err
	}
	if set, err = buildImages(ctx, kubeBin, release, names, dir); err != nil {
		return imageSet{}, err
	}
	return set, writeJSON(filepath.Join(dir, imageSetFile), set)
}

// kubeadmImages are the release of kubeBin's kubeadm and the names of the images it asks for at that
// release (`kubeadm config images list`): the tags of pause, etcd and CoreDNS change between releases.
func kubeadmImages(ctx context.Context, kubeBin string) (string, []string, error) {
	binary := filepath.Join(kubeBin, "kubeadm")
	release, err := (&kubeadm.Exec{Binary: binary}).Version(ctx)
	if err != nil {
		return "", nil, fmt.Errorf("the release of %s: %w", binary, err)
	}
	// Its standard output alone: a warning is no image.
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, binary, "config", "images", "list", "--kubernetes-version", release)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", nil, fmt.Errorf("kubeadm %s config images list: %w: %s", release, err, bytes.TrimSpace(stderr.Bytes()))
	}
	return release, strings.Fields(string(out)), nil
}

// image is the name of the set's image of repository repo, or "" if it has none.
func (s imageSet) image(repo string) string {
	for _, img := range slices.Concat(s.Node, s.ControlPlane) {
		if r, _, _ := strings.Cut(img.Name, ":"); r == repo {
			return img.Name
		}
	}
	return ""
}

// buildImages makes names, the images kubeadm of release asks for, from the built binaries (the pause image
// from the lab's own program), the Flannel images from flanneld and the lab's stand-in for its CNI plugin,
// and the workload images from the lab's own programs, as docker-archive tars. The lab has one etcd and one
// CoreDNS: each release's kubeadm gets them under the tags it asks for.
func buildImages(ctx context.Context, kubeBin, release string, names []string, dir string) (imageSet, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return imageSet{}, err
	}
	pauseBin, err := buildProgram(ctx, "pause", dir)
	if err != nil {
		return imageSet{}, err
	}
	probeBin, err := buildProgram(ctx, "probe", dir)
	if err != nil {
		return imageSet{}, err
	}
	flannelCNIBin, err := buildProgram(ctx, "flannelcni", dir)
	if err != nil {
		return imageSet{}, err
	}
	var commands []string
	for _, c := range iptablesCommands {
		commands = append(commands, "usr/sbin/"+c)
	}
	iptables, err := hostProgram("/usr/sbin/iptables", commands, "/usr/lib/x86_64-linux-gnu/xtables/*.so")
	if err != nil {
		return imageSet{}, fmt.Errorf("kube-proxy's and flanneld's iptables: %w", err)
	}
	// Upstream's manifest installs Flannel's CNI plugin and configuration with cp from the images' PATH.
	cp, err := hostProgram("/bin/cp", []string{"bin/cp"}, "")
	if err != nil {
		return imageSet{}, fmt.Errorf("the Flannel images' cp: %w", err)
	}
	path := "PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	bin := func(name string) ImageFile {
		return ImageFile{Path: "usr/local/bin/" + name, Src: filepath.Join(kubeBin, name), Mode: 0o755}
	}
	nodeImages := []Image{
		{Name: WorkloadImage, Files: []ImageFile{{Path: "sleeper", Src: pauseBin, Mode: 0o755}}, Entrypoint: []string{"/sleeper"}},
		{Name: ProbeImage, Files: []ImageFile{{Path: "probe", Src: probeBin, Mode: 0o755}}, Entrypoint: []string{"/probe"}},
		// Laid out as upstream's: the manifest runs /opt/bin/flanneld, which runs iptables and ip6tables
		// (and their -restore) from PATH.
		{
			Name:       FlannelImage,
			Files:      slices.Concat([]ImageFile{{Path: "opt/bin/flanneld", Src: filepath.Join(kubeBin, "flanneld"), Mode: 0o755}}, iptables, cp),
			Entrypoint: []string{"/opt/bin/flanneld"},
			Env:        []string{path},
		},
		{Name: FlannelCNIImage, Files: append([]ImageFile{{Path: "flannel", Src: flannelCNIBin, Mode: 0o755}}, cp...), Env: []string{path}},
	}
	var controlPlaneImages []Image
	set := imageSet{Kubernetes: release}
	for _, name := range names {
		switch repo, _, _ := strings.Cut(name, ":"); repo {
		case pauseRepository:
			set.Pause = name
			nodeImages = append(nodeImages, Image{Name: name, Files: []ImageFile{{Path: "pause", Src: pauseBin, Mode: 0o755}}, Entrypoint: []string{"/pause"}})
		case "registry.k8s.io/kube-proxy":
			nodeImages = append(nodeImages, Image{Name: name, Files: append([]ImageFile{bin("kube-proxy")}, iptables...), Env: []string{path}})
		case coreDNSRepository:
			// CoreDNS's Deployment runs the image's entrypoint with -conf.
			nodeImages = append(nodeImages, Image{Name: name, Files: []ImageFile{{Path: "coredns", Src: filepath.Join(kubeBin, "coredns"), Mode: 0o755}}, Entrypoint: []string{"/coredns"}})
		case etcdRepository:
			controlPlaneImages = append(controlPlaneImages, Image{Name: name, Files: []ImageFile{bin("etcd")}, Env: []string{path}})
		case "registry.k8s.io/kube-apiserver", "registry.k8s.io/kube-controller-manager", "registry.k8s.io/kube-scheduler":
			controlPlaneImages = append(controlPlaneImages, Image{Name: name, Files: []ImageFile{bin(strings.TrimPrefix(repo, "registry.k8s.io/"))}, Env: []string{path}})
		default:
			return imageSet{}, fmt.Errorf("kubeadm %s asks for %s, which the lab does not make", release, name)
		}
	}
	if set.Node, err = writeImages(nodeImages, dir); err != nil {
		return imageSet{}, err
	}
	if set.ControlPlane, err = writeImages(controlPlaneImages, dir); err != nil {
		return imageSet{}, err
	}
	return set, nil
}

// writeImages writes each of images as a docker-archive tar in dir.
func writeImages(images []Image, dir string) ([]imageArchive, error) {
	var archives []imageArchive
	for _, img := range images {
		path, err := writeImage(img, dir)
		if err != nil {
			return nil, err
		}
		archives = append(archives, imageArchive{Name: img.Name, Path: path})
	}
	return archives, nil
}

// buildProgram builds the lab's program name (a directory beside this file) into dir. It builds by import
// path, so the process must run inside the Berth repository, as make and the tests run it: berth-lab is
// built with -trimpath (test/gobuild), so it does not know where its source lies.
func buildProgram(ctx context.Context, name, dir string) (string, error) {
	out := filepath.Join(dir, name)
	if err := gobuild.Build(ctx, "", "github.com/berthlabs/berth/test/lab/"+name, out, ""); err != nil {
		return "", fmt.Errorf("building %s (from within the Berth repository): %w", name, err)
	}
	return out, nil
}

// hostProgram is a dynamically linked program of the host, at each of paths in the image, with the
// plug-ins it opens at run time (the files pluginGlob matches, as iptables' xtables extensions; "" for none)
// and the shared libraries both load, at the paths where the host's loader finds them.
func hostProgram(program string, paths []string, pluginGlob string) ([]ImageFile, error) {
	real, err := filepath.EvalSymlinks(program)
	if err != nil {
		return nil, err
	}
	var files []ImageFile
	for _, p := range paths {
		files = append(files, ImageFile{Path: p, Src: real, Mode: 0o755})
	}
	objects := []string{real}
	var plugins []string
	if pluginGlob != "" {
		if plugins, err = filepath.Glob(pluginGlob); err != nil {
			return nil, err
		}
		if len(plugins) == 0 {
			return nil, fmt.Errorf("no plug-ins of %s match %s", program, pluginGlob)
		}
	}
	for _, p := range plugins {
		files = append(files, ImageFile{Path: strings.TrimPrefix(p, "/"), Src: p, Mode: 0o644})
	}
	objects = append(objects, plugins...)
	libs := map[string]bool{}
	for _, o := range objects {
		out, err := exec.Command("ldd", o).Output()
		if err != nil {
			return nil, fmt.Errorf("ldd %s: %w", o, err)
		}
		for _, line := range strings.Split(string(out), "\n") {
			// "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)" or the loader's "/lib64/ld-linux-x86-64.so.2 (0x…)".
			f := strings.Fields(line)
			switch {
			case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
				libs[f[2]] = true
			case len(f) == 2 && strings.HasPrefix(f[0], "/"):
				libs[f[0]] = true
			}
		}
	}
	for _, lib := range slices.Sorted(maps.Keys(libs)) {
		src, err := filepath.EvalSymlinks(lib)
		if err != nil {
			return nil, err
		}
		files = append(files, ImageFile{Path: strings.TrimPrefix(lib, "/"), Src: src, Mode: 0o755})
	}
	return files, nil
}

// writeImage writes img into dir as a docker-archive tar named after it.
func writeImage(img Image, dir string) (string, error) {
	name := strings.NewReplacer("/", "_", ":", "_").Replace(img.Name) + ".tar"
	tarPath := filepath.Join(dir, name)
	f, err := os.Create(tarPath)
	if err != nil {
		return "", err
	}
	err = img.WriteDockerArchive(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", fmt.Errorf("%s: %w", img.Name, err)
	}
	return tarPath, nil
}

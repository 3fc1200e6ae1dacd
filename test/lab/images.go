package lab

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
)

// Image names kubeadm v1.36.3 asks for (`kubeadm config images list`), and the lab's test workload.
const (
	pauseImage    = "registry.k8s.io/pause:3.10.2"
	etcdImage     = "registry.k8s.io/etcd:3.6.8-0"
	WorkloadImage = "berthlab.local/sleeper:v1"
)

// imageSet is where buildImages wrote the images; lab.json keeps it for the processes that add nodes.
type imageSet struct {
	Pause        string   `json:"pause"`
	PauseTar     string   `json:"pauseTar"`
	WorkloadTar  string   `json:"workloadTar"`
	ControlPlane []string `json:"controlPlane"`
}

// buildImages makes the control-plane images from the built binaries, and the pause and workload images
// from the lab's pause program, as docker-archive tars.
func buildImages(ctx context.Context, kubeBin, dir string) (imageSet, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return imageSet{}, err
	}
	pauseBin := filepath.Join(dir, "pause")
	_, file, _, _ := runtime.Caller(0)
	// -C: the command may run outside the module (from Terraform's working directory, say).
	if _, err := runEnv(ctx, []string{"CGO_ENABLED=0"}, "go", "build", "-C", filepath.Join(filepath.Dir(file), "pause"),
		"-trimpath", "-ldflags=-s -w", "-o", pauseBin, "."); err != nil {
		return imageSet{}, err
	}
	path := "PATH=/usr/local/bin:/usr/bin:/bin"
	bin := func(name string) ImageFile {
		return ImageFile{Path: "usr/local/bin/" + name, Src: filepath.Join(kubeBin, name), Mode: 0o755}
	}
	images := []Image{
		{Name: pauseImage, Files: []ImageFile{{Path: "pause", Src: pauseBin, Mode: 0o755}}, Entrypoint: []string{"/pause"}},
		{Name: WorkloadImage, Files: []ImageFile{{Path: "sleeper", Src: pauseBin, Mode: 0o755}}, Entrypoint: []string{"/sleeper"}},
		{Name: etcdImage, Files: []ImageFile{bin("etcd")}, Env: []string{path}},
	}
	for _, c := range []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler"} {
		images = append(images, Image{Name: "registry.k8s.io/" + c + ":" + KubernetesVersion, Files: []ImageFile{bin(c)}, Env: []string{path}})
	}
	set := imageSet{Pause: pauseImage}
	for _, img := range images {
		name := strings.NewReplacer("/", "_", ":", "_").Replace(img.Name) + ".tar"
		tarPath := filepath.Join(dir, name)
		f, err := os.Create(tarPath)
		if err != nil {
			return imageSet{}, err
		}
		err = img.WriteDockerArchive(f)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return imageSet{}, fmt.Errorf("%s: %w", img.Name, err)
		}
		switch img.Name {
		case pauseImage:
			set.PauseTar = tarPath
		case WorkloadImage:
			set.WorkloadTar = tarPath
		default:
			set.ControlPlane = append(set.ControlPlane, tarPath)
		}
	}
	return set, nil
}

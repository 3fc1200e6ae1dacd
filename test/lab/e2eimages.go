package lab

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
)

// E2ERepoList is the suite's own image override (KUBE_TEST_REPO_LIST): its test images under names of the
// lab's, so that no node ever takes a lab-made image for upstream's or tries a registry it cannot reach.
// pause and etcd keep kubeadm's names, which the lab already makes.
const E2ERepoList = `promoterE2eRegistry: berthlab.local/e2e-test-images
dockerLibraryRegistry: berthlab.local/library
buildImageRegistry: berthlab.local/build-image
sigStorageRegistry: berthlab.local/sig-storage
cloudProviderGcpRegistry: berthlab.local/cloud-provider-gcp
`

// E2EImages are the images the suite lists (e2e.test --list-images under E2ERepoList), made here from the
// Kubernetes module's test images and Debian's programs, as docker-archive tars; Missing names each image
// the lab cannot make, with the reason, so that the tests that need one are reported, not silently lost.
type E2EImages struct {
	Tars    []string
	Missing map[string]string
}

// e2eBuild is what the suite's images are made of: the binaries scripts/build-e2e.sh built into bin (e2e.test,
// agnhost, nnp) and the Kubernetes module's sources of the test images.
type e2eBuild struct {
	bin, images string
	busybox     []ImageFile
	// netTools are the network clients upstream's agnhost takes from Alpine (curl, dig, nc, getent),
	// Debian's here, and a shell that runs them.
	netTools []ImageFile
}

// BuildE2EImages makes, in dir, every image the suite in bin lists that the lab can make.
func (l *Lab) BuildE2EImages(ctx context.Context, bin, k8sSource, dir string) (E2EImages, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return E2EImages{}, err
	}
	repoList := filepath.Join(dir, "repo-list.yaml")
	if err := os.WriteFile(repoList, []byte(E2ERepoList), 0o644); err != nil {
		return E2EImages{}, err
	}
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "e2e.test"), "--list-images")
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+repoList)
	out, err := cmd.Output()
	if err != nil {
		return E2EImages{}, fmt.Errorf("e2e.test --list-images: %w", err)
	}
	busybox, err := busyboxFiles()
	if err != nil {
		return E2EImages{}, err
	}
	b := e2eBuild{bin: bin, images: filepath.Join(k8sSource, "test", "images"), busybox: busybox}
	for _, p := range []struct{ host, image string }{
		{"/usr/bin/curl", "usr/bin/curl"}, {"/usr/bin/dig", "usr/bin/dig"}, {"/usr/bin/nc.openbsd", "usr/bin/nc"},
		{"/usr/bin/getent", "usr/bin/getent"},
		// Debian's busybox runs its own applets before any program on PATH (a standalone shell): with it as
		// sh, "nc" in a test's script would never be netcat. dash takes its place.
		{"/usr/bin/dash", "bin/sh"},
	} {
		files, err := hostProgram(p.host, []string{p.image}, "")
		if err != nil {
			return E2EImages{}, fmt.Errorf("%s (scripts/install-deps.sh installs it): %w", p.host, err)
		}
		b.netTools = append(b.netTools, files...)
	}
	// glibc's getent resolves through NSS, which reads this; the kubelet mounts /etc/hosts and resolv.conf.
	b.netTools = append(b.netTools, ImageFile{Path: "etc/nsswitch.conf", Data: []byte("hosts: files dns\n"), Mode: 0o644})
	set := E2EImages{Missing: map[string]string{}}
	for _, ref := range strings.Fields(string(out)) {
		if ref == l.images.Pause || ref == l.images.image(etcdRepository) {
			continue // kubeadm's, which every node (etcd: every control-plane node) has
		}
		img, why := b.image(ref)
		if why != "" {
			set.Missing[ref] = why
			continue
		}
		tar, err := writeImage(img, dir)
		if err != nil {
			return E2EImages{}, err
		}
		set.Tars = append(set.Tars, tar)
	}
	return set, nil
}

// image is the lab's make of the suite's image ref, or why there is none.
func (b e2eBuild) image(ref string) (Image, string) {
	repo, _, _ := strings.Cut(ref, ":")
	if !strings.HasPrefix(repo, "berthlab.local/") {
		return Image{}, "named by the suite outside its registry list: an image the lab cannot rename"
	}
	agnhost := append(slices.Concat(b.netTools, b.busybox),
		ImageFile{Path: "agnhost", Src: filepath.Join(b.bin, "agnhost"), Mode: 0o755},
		ImageFile{Path: "agnhost-2", Link: "agnhost"},
		ImageFile{Path: "localhost.crt", Src: filepath.Join(b.images, "agnhost", "porter", "localhost.crt"), Mode: 0o644},
		ImageFile{Path: "localhost.key", Src: filepath.Join(b.images, "agnhost", "porter", "localhost.key"), Mode: 0o644},
		ImageFile{Path: "uploads"},
	)
	// Alpine's PATH, which upstream's images inherit: Debian's programs in /usr/bin come before busybox's.
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	switch name := path.Base(repo); name {
	case "busybox":
		return Image{Name: ref, Files: b.busybox, Cmd: []string{"sh"}, Env: env}, ""
	case "agnhost":
		return Image{Name: ref, Files: agnhost, Entrypoint: []string{"/agnhost"}, Cmd: []string{"pause"}, Env: env}, ""
	case "kitten", "nautilus":
		html := filepath.Join(b.images, name, "html")
		files := append(agnhost,
			ImageFile{Path: name + ".jpg", Src: filepath.Join(html, name+".jpg"), Mode: 0o644},
			ImageFile{Path: "data.json", Src: filepath.Join(html, "data.json"), Mode: 0o644})
		return Image{Name: ref, Files: files, Entrypoint: []string{"/agnhost"}, Cmd: []string{"test-webserver"}, Env: env}, ""
	case "nonewprivs":
		files := append(slices.Clone(b.busybox), ImageFile{Path: "usr/local/bin/nnp", Src: filepath.Join(b.bin, "nnp"), Mode: 0o4755})
		return Image{Name: ref, Files: files, Cmd: []string{"nnp"}, Env: env}, ""
	case "nginx":
		// A stand-in: the suite runs nginx as a web server on port 80 that has a shell; busybox's httpd is one.
		files := append(slices.Clone(b.busybox), ImageFile{Path: "usr/share/nginx/html/index.html", Data: []byte("<h1>" + ref + "</h1>\n"), Mode: 0o644})
		return Image{Name: ref, Files: files, Cmd: []string{"httpd", "-f", "-p", "80", "-h", "/usr/share/nginx/html"}, Env: env}, ""
	case "glibc-dns-testing":
		return Image{Name: ref, Files: slices.Concat(b.netTools, b.busybox), Cmd: []string{"sh"}, Env: env}, ""
	case "nonroot":
		return Image{Name: ref, Files: b.busybox, Cmd: []string{"sh"}, User: "1234", Env: env}, ""
	}
	return Image{}, "not made by the lab"
}

// busyboxFiles are Debian's static busybox as /bin/busybox, a link for each of its applets, and the
// /etc/passwd and /etc/group of the busybox image.
func busyboxFiles() ([]ImageFile, error) {
	out, err := exec.Command("/bin/busybox", "--list").Output()
	if err != nil {
		return nil, fmt.Errorf("busybox --list (Debian's busybox-static): %w", err)
	}
	files := []ImageFile{
		{Path: "bin/busybox", Src: "/bin/busybox", Mode: 0o755},
		{Path: "etc/passwd", Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n"), Mode: 0o644},
		{Path: "etc/group", Data: []byte("root:x:0:\nnogroup:x:65534:\n"), Mode: 0o644},
		{Path: "tmp", Mode: 0o1777},
		{Path: "root", Mode: 0o700},
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet != "busybox" {
			files = append(files, ImageFile{Path: "bin/" + applet, Link: "busybox"})
		}
	}
	return files, nil
}

// LoadImages imports the docker-archive tars into the containerd of every node this lab knows, for pods of
// images made after the nodes were. Nodes keep them across power cycles (their containerd's root is on
// their disk); nodes added later do not have them.
func (l *Lab) LoadImages(ctx context.Context, tars []string) error {
	for _, n := range l.Nodes {
		for _, tar := range tars {
			if _, err := n.exec(ctx, "ctr", "-n", "k8s.io", "images", "import", tar); err != nil {
				return fmt.Errorf("node %s: %w", n.Name, err)
			}
		}
		l.progress("%s: %d images loaded", n.Name, len(tars))
	}
	return nil
}

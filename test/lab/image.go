package lab

import (
	"archive/tar"
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
)

// ImageFile is one file of an image's only layer: a copy of a host file, a symbolic link, or (with neither
// Src nor Link) a directory.
type ImageFile struct {
	Path string // inside the image, without a leading slash
	Src  string // on the host
	Link string // the target, for a symbolic link
	Data []byte // the content, for a file made here instead of copied (Src empty)
	Mode int64
}

// Image is a single-layer container image made from local files: enough for static binaries, and loadable
// with `ctr images import` without any registry.
type Image struct {
	Name       string // full reference, e.g. registry.k8s.io/pause:3.10.1
	Files      []ImageFile
	Entrypoint []string
	Cmd        []string
	Env        []string
	User       string
	WorkingDir string
}

// WriteDockerArchive writes img in the docker-archive format (`docker save`): a layer tar, the image
// config and manifest.json. Timestamps and owners are fixed, so the same files give the same image id.
func (img Image) WriteDockerArchive(w io.Writer) error {
	layer, err := img.layer()
	if err != nil {
		return fmt.Errorf("image %s: %w", img.Name, err)
	}
	diffID := sha256.Sum256(layer)
	config, err := json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"config": map[string]any{"Entrypoint": img.Entrypoint, "Cmd": img.Cmd, "Env": img.Env, "User": img.User,
			"WorkingDir": img.WorkingDir},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + hex.EncodeToString(diffID[:])}},
	})
	if err != nil {
		return err
	}
	configSum := sha256.Sum256(config)
	configName := hex.EncodeToString(configSum[:]) + ".json"
	manifest, err := json.Marshal([]map[string]any{{
		"Config": configName, "RepoTags": []string{img.Name}, "Layers": []string{"layer/layer.tar"},
	}})
	if err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	for _, e := range []struct {
		name string
		data []byte
	}{{"layer/layer.tar", layer}, {configName, config}, {"manifest.json", manifest}} {
		if err := tw.WriteHeader(&tar.Header{Name: e.name, Mode: 0o644, Size: int64(len(e.data)), Format: tar.FormatPAX}); err != nil {
			return err
		}
		if _, err := tw.Write(e.data); err != nil {
			return err
		}
	}
	return tw.Close()
}

func (img Image) layer() ([]byte, error) {
	files := append([]ImageFile(nil), img.Files...)
	sort.SliceStable(files, func(i, j int) bool { return files[i].Path < files[j].Path })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	for i, f := range files {
		// Programs copied from the host share libraries: the first of a path wins.
		if i > 0 && files[i-1].Path == f.Path {
			continue
		}
		for _, d := range parents(f.Path) {
			if dirs[d] {
				continue
			}
			dirs[d] = true
			if err := tw.WriteHeader(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: 0o755, Format: tar.FormatPAX}); err != nil {
				return nil, err
			}
		}
		switch {
		case f.Link != "":
			if err := tw.WriteHeader(&tar.Header{Name: f.Path, Typeflag: tar.TypeSymlink, Linkname: f.Link, Mode: 0o777, Format: tar.FormatPAX}); err != nil {
				return nil, err
			}
			continue
		case f.Src == "" && f.Data == nil:
			if dirs[f.Path] {
				continue
			}
			dirs[f.Path] = true
			if err := tw.WriteHeader(&tar.Header{Name: f.Path + "/", Typeflag: tar.TypeDir, Mode: cmp.Or(f.Mode, 0o755), Format: tar.FormatPAX}); err != nil {
				return nil, err
			}
			continue
		}
		data := f.Data
		if f.Src != "" {
			var err error
			if data, err = os.ReadFile(f.Src); err != nil {
				return nil, err
			}
		}
		if err := tw.WriteHeader(&tar.Header{Name: f.Path, Mode: f.Mode, Size: int64(len(data)), Format: tar.FormatPAX}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// parents are the directories above path, outermost first ("usr", "usr/local", …).
func parents(path string) []string {
	var out []string
	for i := 0; i < len(path); i++ {
		if path[i] == '/' {
			out = append(out, path[:i])
		}
	}
	return out
}

// Package test holds the repository's test harnesses; this file enforces the line between them and the
// programs, as the standard library's go/build deps test does for its own layers.
package test

import (
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"path"
	"slices"
	"strings"
	"testing"

	"github.com/berthlabs/berth/internal/repotest"
)

const module = "github.com/berthlabs/berth"

// The three programs Berth ships.
var programs = []string{module, module + "/nodeagent/cmd/berth-agent", module + "/packer/cmd/packer-plugin-berth"}

type goPackage struct {
	ImportPath string
	Imports    []string
	// TestImports and XTestImports are what the package's _test.go files import.
	TestImports, XTestImports []string
}

// listPackages runs go list -deps on patterns and returns the packages of this module by import path.
func listPackages(t *testing.T, patterns ...string) map[string]goPackage {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-deps", "-json=ImportPath,Imports,TestImports,XTestImports"}, patterns...)...)
	cmd.Dir = repotest.Root(t)
	out, err := cmd.Output()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			t.Fatalf("go list %v: %v\n%s", patterns, err, exit.Stderr)
		}
		t.Fatalf("go list %v: %v", patterns, err)
	}
	pkgs := map[string]goPackage{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p goPackage
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("reading go list's output: %v", err)
		}
		if p.ImportPath == module || strings.HasPrefix(p.ImportPath, module+"/") {
			pkgs[p.ImportPath] = p
		}
	}
	return pkgs
}

// isTestPackage says whether a package of this module exists for tests: it lies in a test tree, or its
// own (non-test) files import package testing, which only a harness has reason to do.
func isTestPackage(p goPackage) bool {
	return slices.Contains(strings.Split(p.ImportPath, "/"), "test") || slices.Contains(p.Imports, "testing")
}

// recognisable says whether a test package's path tells that it is one: a test tree, or a name ending in
// "test" (httptest, swtpmtest), so that a directory listing separates product from harness.
func recognisable(importPath string) bool {
	return slices.Contains(strings.Split(importPath, "/"), "test") || strings.HasSuffix(path.Base(importPath), "test")
}

// importChain is a shortest chain of imports from one package to another within pkgs.
func importChain(pkgs map[string]goPackage, from, to string) []string {
	prev := map[string]string{from: ""}
	queue := []string{from}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		if cur == to {
			chain := []string{cur}
			for p := prev[cur]; p != ""; p = prev[p] {
				chain = append([]string{p}, chain...)
			}
			return chain
		}
		for _, imp := range pkgs[cur].Imports {
			if _, seen := prev[imp]; !seen {
				if _, ours := pkgs[imp]; ours {
					prev[imp] = cur
					queue = append(queue, imp)
				}
			}
		}
	}
	return nil
}

// TestProgramsDependOnNoTestPackage fails when one of the three programs links a test harness (directly or
// through another package), naming the chain of imports, and when a package that imports package testing
// is not named as a test package.
func TestProgramsDependOnNoTestPackage(t *testing.T) {
	all := listPackages(t, "./...")
	var harnesses int
	for _, p := range all {
		if !isTestPackage(p) {
			continue
		}
		harnesses++
		if !recognisable(p.ImportPath) {
			t.Errorf("%s imports package testing but is not named as a test package: move it under a test/ tree or name it <something>test beside what it drives", p.ImportPath)
		}
	}
	if harnesses == 0 {
		t.Fatal("found no test package at all: the rule that finds them is broken")
	}
	for _, prog := range programs {
		deps := listPackages(t, prog)
		if _, ok := deps[prog]; !ok {
			t.Fatalf("go list -deps %s did not list the program itself", prog)
		}
		for _, p := range deps {
			if isTestPackage(p) {
				t.Errorf("program %s depends on test package %s: %s", prog, p.ImportPath, strings.Join(importChain(deps, prog, p.ImportPath), " → "))
			}
		}
	}
}

// programTrees are the directories of each program's own code: what only that program uses belongs under
// its internal/, where Go itself keeps the others out.
var programTrees = map[string]string{
	module:                                "provider",
	module + "/nodeagent/cmd/berth-agent": "nodeagent",
	module + "/packer/cmd/packer-plugin-berth": "packer",
}

// TestInternalIsShared fails when a product package in the module's internal/ is linked into one program
// only (or none) and no code outside that program's tree imports it, tests included: it belongs under that
// program's internal/. Go keeps code outside a tree from importing the tree's internal packages, tests too,
// so a package that the agent and the lab both use, or that a provider test holds the provider's copy of a
// default against, stays shared.
func TestInternalIsShared(t *testing.T) {
	all := listPackages(t, "./...")
	linkedBy := map[string][]string{}
	for prog, tree := range programTrees {
		for p := range listPackages(t, prog) {
			linkedBy[p] = append(linkedBy[p], tree)
		}
	}
	var checked int
	for _, p := range all {
		if !strings.HasPrefix(p.ImportPath, module+"/internal/") || isTestPackage(p) || recognisable(p.ImportPath) {
			continue
		}
		checked++
		trees := linkedBy[p.ImportPath]
		if len(trees) > 1 {
			continue
		}
		var owner string
		if len(trees) == 1 {
			owner = module + "/" + trees[0] + "/"
		}
		var outside []string
		for _, q := range all {
			imports := slices.Concat(q.Imports, q.TestImports, q.XTestImports)
			if q.ImportPath != p.ImportPath && slices.Contains(imports, p.ImportPath) && (owner == "" || !strings.HasPrefix(q.ImportPath+"/", owner)) {
				outside = append(outside, q.ImportPath)
			}
		}
		switch {
		case len(trees) == 0 && len(outside) == 0:
			t.Errorf("%s is linked into no program and imported by no test harness: remove it", p.ImportPath)
		case len(trees) == 0:
			t.Errorf("%s is linked into no program, only imported by tests (%s): move it under test/", p.ImportPath, strings.Join(outside, ", "))
		case len(outside) == 0:
			t.Errorf("%s is linked into %s only, and no harness outside it needs it: move it under %s/internal/", p.ImportPath, trees[0], trees[0])
		}
	}
	if checked == 0 {
		t.Fatal("found no product package under internal/: the rule that finds them is broken")
	}
}

package nodestate

import (
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func TestLockHasOneWinner(t *testing.T) {
	var l Lock
	var wg sync.WaitGroup
	wins := make(chan string, 2)
	for _, owner := range []string{OwnerInit, OwnerJoin} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if l.TryLock(owner) {
				wins <- owner
			}
		}()
	}
	wg.Wait()
	close(wins)
	var won []string
	for w := range wins {
		won = append(won, w)
	}
	if len(won) != 1 || l.Owner() != won[0] {
		t.Fatalf("winners %v, owner %q", won, l.Owner())
	}
	if l.TryLock(won[0]) {
		t.Fatal("the lock was taken twice by its owner")
	}
}

func TestStateRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "nested")
	if _, err := Read(dir); !errors.Is(err, ErrNoState) {
		t.Fatalf("Read of nothing: %v, want ErrNoState", err)
	}
	want := &State{ClusterID: "c1", NodeName: "w1", Role: "worker", Via: OwnerJoin, Since: time.Unix(1700000000, 0).UTC()}
	if err := Write(dir, want); err != nil {
		t.Fatal(err)
	}
	got, err := Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	if *got != *want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	fi, err := os.Stat(filepath.Join(dir, stateFile))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("state file mode %v, %v", fi.Mode(), err)
	}
	if err := os.WriteFile(filepath.Join(dir, stateFile), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(dir); err == nil || errors.Is(err, ErrNoState) {
		t.Fatalf("torn state file: %v", err)
	}
}

func TestSecretsRoundTrip(t *testing.T) {
	dir := t.TempDir()
	if _, err := ReadSecrets(dir); !errors.Is(err, ErrNoState) {
		t.Fatalf("ReadSecrets of nothing: %v", err)
	}
	want := &ClusterSecrets{MasterSecret: []byte{1, 2}, Salt: []byte{3}, JoinCACert: []byte("c"), JoinCAKey: []byte("k"),
		APIServerEndpoint: "10.0.0.1:6443", KubernetesVersion: "v1.36.3"}
	if err := WriteSecrets(dir, want); err != nil {
		t.Fatal(err)
	}
	got, err := ReadSecrets(dir)
	if err != nil {
		t.Fatal(err)
	}
	if string(got.MasterSecret) != string(want.MasterSecret) || got.APIServerEndpoint != want.APIServerEndpoint || string(got.JoinCAKey) != "k" {
		t.Fatalf("got %+v", got)
	}
	fi, err := os.Stat(filepath.Join(dir, secretsFile))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("secrets file mode %v, %v", fi.Mode(), err)
	}
}

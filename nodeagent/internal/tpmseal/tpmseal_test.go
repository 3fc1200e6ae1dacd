package tpmseal

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strings"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/berthlabs/berth/test/swtpm/swtpmtest"
)

// newTPM starts a swtpm and opens its command channel.
func newTPM(t *testing.T) transport.TPM {
	t.Helper()
	if _, err := exec.LookPath("swtpm"); err != nil {
		t.Fatalf("swtpm not found: run make deps (%v)", err)
	}
	conn, err := net.Dial("unix", swtpmtest.NewCA(t).NewTPM(t).Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return transport.FromReadWriter(conn)
}

// current is a branch of the TPM's PCRs now.
func current(t *testing.T, tpm transport.TPM, name string, pcrs ...int) Branch {
	t.Helper()
	values, err := readPCRs(tpm, pcrs)
	if err != nil {
		t.Fatal(err)
	}
	return Branch{Name: name, PCRs: values}
}

func other(name string, pcrs ...int) Branch {
	b := Branch{Name: name, PCRs: map[int][]byte{}}
	for _, i := range pcrs {
		d := sha256.Sum256([]byte(fmt.Sprint(name, i)))
		b.PCRs[i] = d[:]
	}
	return b
}

func extend(t *testing.T, tpm transport.TPM, pcr int, data string) {
	t.Helper()
	d := sha256.Sum256([]byte(data))
	_, err := tpm2.PCRExtend{
		PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(pcr), Auth: tpm2.PasswordAuth(nil)},
		Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: d[:]}}},
	}.Execute(tpm)
	if err != nil {
		t.Fatal(err)
	}
}

func noTransientHandles(t *testing.T, tpm transport.TPM) {
	t.Helper()
	rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: uint32(tpm2.TPMHTTransient) << 24, PropertyCount: 16}.Execute(tpm)
	if err != nil {
		t.Fatal(err)
	}
	handles, err := rsp.CapabilityData.Data.Handles()
	if err != nil {
		t.Fatal(err)
	}
	if len(handles.Handle) != 0 {
		t.Errorf("transient handles left loaded: %v", handles.Handle)
	}
}

func TestSealUnseal(t *testing.T) {
	tpm := newTPM(t)
	extend(t, tpm, 16, "this boot")
	secret := []byte("the disk key and the policy's digest")
	for _, tc := range []struct {
		name  string
		count int
		at    int
	}{{"one image", 1, 0}, {"twenty images, the tree three levels deep", 20, 13}} {
		t.Run(tc.name, func(t *testing.T) {
			branches := make([]Branch, tc.count)
			for i := range branches {
				branches[i] = other(fmt.Sprint("image-", i), 4, 16)
			}
			branches[tc.at] = current(t, tpm, "this-image", 4, 16)
			sealed, err := Seal(tpm, secret, branches)
			if err != nil {
				t.Fatalf("Seal: %v", err)
			}
			got, branch, err := Unseal(tpm, sealed, branches)
			if err != nil {
				t.Fatalf("Unseal: %v", err)
			}
			if !bytes.Equal(got, secret) || branch != tc.at {
				t.Errorf("Unseal = %q, branch %d; want %q, branch %d", got, branch, secret, tc.at)
			}
			noTransientHandles(t, tpm)
		})
	}
}

// The offline digest is the one the TPM computes for the same policy commands.
func TestPolicyDigestMatchesTheTPM(t *testing.T) {
	tpm := newTPM(t)
	b := current(t, tpm, "this-image", 0, 7, 11)
	want, err := PolicyDigest([]Branch{b})
	if err != nil {
		t.Fatal(err)
	}
	sess, closeSession, err := tpm2.PolicySession(tpm, tpm2.TPMAlgSHA256, 16, tpm2.Trial())
	if err != nil {
		t.Fatal(err)
	}
	defer closeSession()
	if _, err := policyPCR(b).execute(tpm, sess.Handle()); err != nil {
		t.Fatal(err)
	}
	if _, err := (tpm2.PolicyOr{PolicySession: sess.Handle(), PHashList: orList([][]byte{mustLeaf(t, b)}, 0)}).Execute(tpm); err != nil {
		t.Fatal(err)
	}
	got, err := tpm2.PolicyGetDigest{PolicySession: sess.Handle()}.Execute(tpm)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.PolicyDigest.Buffer, want) {
		t.Errorf("the TPM's digest %x, PolicyDigest %x", got.PolicyDigest.Buffer, want)
	}
	again, _ := PolicyDigest([]Branch{b})
	changed := other("x", 0, 7, 11)
	reordered, _ := PolicyDigest([]Branch{changed, b})
	ordered, _ := PolicyDigest([]Branch{b, changed})
	if !bytes.Equal(again, want) || bytes.Equal(reordered, ordered) {
		t.Error("PolicyDigest is not deterministic, or ignores the order of branches")
	}
}

func mustLeaf(t *testing.T, b Branch) []byte {
	t.Helper()
	levels, err := tree([]Branch{b})
	if err != nil {
		t.Fatal(err)
	}
	return levels[0][0]
}

func TestUnsealRefusesAnotherBoot(t *testing.T) {
	tpm := newTPM(t)
	branches := []Branch{current(t, tpm, "image-a", 4, 16), other("image-b", 4, 16)}
	sealed, err := Seal(tpm, []byte("secret"), branches)
	if err != nil {
		t.Fatal(err)
	}
	want := branches[0].PCRs[16]
	extend(t, tpm, 16, "an image outside the policy")
	_, _, err = Unseal(tpm, sealed, branches)
	var mismatch *MismatchError
	if !errors.As(err, &mismatch) || mismatch.Image != "image-a" || mismatch.PCR != 16 || !bytes.Equal(mismatch.Expected, want) {
		t.Fatalf("Unseal after extending PCR 16 = %v, want a mismatch of image-a at PCR 16", err)
	}
	for _, s := range []string{"PCR 16", "image-a", fmt.Sprintf("%x", want), fmt.Sprintf("%x", mismatch.Got)} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("the error %q does not name %s", err, s)
		}
	}
	noTransientHandles(t, tpm)

	// Sealed again with the new value as a branch, it unseals.
	branches = append(branches, current(t, tpm, "image-c", 4, 16))
	if sealed, err = Seal(tpm, []byte("secret"), branches); err != nil {
		t.Fatal(err)
	}
	if _, branch, err := Unseal(tpm, sealed, branches); err != nil || branch != 2 {
		t.Fatalf("Unseal = branch %d, %v; want image-c", branch, err)
	}
}

func TestUnsealAfterClear(t *testing.T) {
	tpm := newTPM(t)
	branches := []Branch{current(t, tpm, "image-a", 0, 7)}
	sealed, err := Seal(tpm, []byte("secret"), branches)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := (tpm2.Clear{AuthHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHLockout, Auth: tpm2.PasswordAuth(nil)}}).Execute(tpm); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Unseal(tpm, sealed, branches); !errors.Is(err, ErrOtherTPM) {
		t.Fatalf("Unseal after TPM2_Clear = %v, want ErrOtherTPM", err)
	}
	noTransientHandles(t, tpm)
}

func TestUnsealRefusesTamperedBranches(t *testing.T) {
	tpm := newTPM(t)
	branches := []Branch{current(t, tpm, "image-a", 0, 7)}
	sealed, err := Seal(tpm, []byte("secret"), branches)
	if err != nil {
		t.Fatal(err)
	}
	tampered := []Branch{other("image-a", 0, 7)}
	if _, _, err := Unseal(tpm, sealed, tampered); err == nil || !strings.Contains(err.Error(), "not the ones it was sealed with") {
		t.Fatalf("Unseal with other branches = %v, want them refused", err)
	}
}

func TestValidation(t *testing.T) {
	short := other("short", 7)
	short.PCRs[7] = short.PCRs[7][:20]
	many := make([]Branch, MaxBranches+1)
	for i := range many {
		many[i] = other("x", 7)
	}
	for _, tc := range []struct {
		name     string
		branches []Branch
		want     string
	}{
		{"none", nil, "no images"},
		{"too many", many, "more than the limit"},
		{"no PCRs", []Branch{{Name: "empty", PCRs: map[int][]byte{}}}, "no PCRs"},
		{"index", []Branch{other("high", 24)}, "outside 0 to 23"},
		{"value", []Branch{short}, "want 32"},
	} {
		if _, err := PolicyDigest(tc.branches); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: PolicyDigest = %v, want an error with %q", tc.name, err, tc.want)
		}
	}
}

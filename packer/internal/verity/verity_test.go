package verity

import (
	"os/exec"
	"strings"
	"testing"
)

func TestVerifiedCmdline(t *testing.T) {
	const record = "0c3c6a0e-5b1f-4d6e-9a51-8f0e3c2d1b4a:150000:614400000:" +
		"9b1d8d816bc39c822910a8d8cc5f9b859477bc1f1347d2590bb90a2c3ee7cd3b:6067197deee2f04c1be0cadb27697c26de1863feebf562bd249c809a88663a78"
	const verity = "root=/dev/mapper/berth-root rootfstype=erofs ro berth.verity=" + record
	for _, tc := range []struct{ line, record, want, err string }{
		{line: "root=PARTUUID=6d3a ro console=ttyS0 rootflags=discard", record: record + "\n",
			want: "console=ttyS0 " + verity + " panic=30"},
		{line: "root=UUID=6b1e rw quiet panic=-1 berth.verity=old -- single", record: record,
			want: "quiet panic=-1 " + verity + " -- single"},
		{line: "console=ttyS0", record: strings.ToUpper(record), err: "is not <partition UUID>"},
		{line: "console=ttyS0", record: "0c3c6a0e-5b1f-4d6e-9a51-8f0e3c2d1b4a:150000:614400000:abc:def", err: "is not <partition UUID>"},
		{line: "console=ttyS0", record: "", err: "is not <partition UUID>"},
	} {
		got, err := Cmdline(tc.line, tc.record)
		if got != tc.want || (err == nil) != (tc.err == "") || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("Cmdline(%q, %q) = %q, %v; want %q, error containing %q", tc.line, tc.record, got, err, tc.want, tc.err)
		}
	}
}

// TestScripts checks the shell of the initramfs-tools pieces and of InitrdScript, and that the script
// installs each piece as it is; TestAccQEMUImage and TestAccNodeImage run them and boot or check the result.
func TestScripts(t *testing.T) {
	script := InitrdScript("/boot/efi")
	for name, s := range map[string]string{"hook": InitramfsHook, "local-top": InitramfsLocalTop,
		"init-bottom": InitramfsInitBottom, "InitrdScript": script} {
		cmd := exec.Command("sh", "-n")
		cmd.Stdin = strings.NewReader(s)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s is not valid sh: %v\n%s", name, err, out)
		}
	}
	for name, s := range map[string]string{"hook": InitramfsHook, "local-top": InitramfsLocalTop, "init-bottom": InitramfsInitBottom} {
		if !strings.Contains(script, "<<'BERTH_EOF'\n"+s+"BERTH_EOF\n") {
			t.Errorf("InitrdScript does not install the %s piece as it is", name)
		}
	}
}

// Package luks manages LUKS2 volumes by driving the cryptsetup command-line tool.
//
// It uses the cryptsetup CLI rather than libcryptsetup on purpose: binding the library needs cgo, which would
// cost berth-agent its static, dependency-free binary; cryptsetup is packaged on every distribution a node
// image is built from; and its command line is a stable, documented interface that changes far more slowly
// than the library's ABI.
//
// Keys never touch the disk and never appear in a command line (where any local user could read them from
// /proc): the key that authorizes an operation goes through cryptsetup's standard input (--key-file=-), and
// a second key, when one is needed, through an inherited pipe that cryptsetup reads as /proc/self/fd/3.
package luks

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/google/uuid"
)

// ErrWrongKey reports that a key opens no keyslot of the volume.
var ErrWrongKey = errors.New("key opens no keyslot of the volume")

const (
	// MinKeySize is the shortest key accepted for a new keyslot. Keyslots use a cheap KDF (see kdfArgs), which
	// is only safe because every key is a full-entropy secret of at least this many bytes.
	MinKeySize = 32
	// MaxKeySize is the longest key accepted for a new keyslot; it keeps a key within one write to a pipe.
	MaxKeySize = 4096
	// MaxLabelSize is the longest label LUKS2 stores (a 48-byte field that ends with NUL).
	MaxLabelSize = 47
	// MaxTokenSize bounds one token's JSON so that two fit in the metadata area Format makes (metadataSize),
	// beside the keyslots: a token is replaced by adding the new one before removing the old.
	MaxTokenSize = 48 << 10
	// metadataSize is the size of each of the two LUKS2 metadata copies (binary header and JSON) that Format
	// makes: cryptsetup's default of 16 KiB keeps only about 12 KiB of JSON, too little for a key sealed to
	// a few dozen images. It comes out of the 16 MiB cryptsetup reserves before the data anyway.
	metadataSize = "128k"
	// maxSlot is the highest keyslot number LUKS2 has.
	maxSlot = 31
	// maxToken is the highest token id LUKS2 has.
	maxToken = 31
	// mapperDir is where device-mapper puts the devices that cryptsetup open creates.
	mapperDir = "/dev/mapper/"
	// noLabel is what luksDump prints for a volume without a label.
	noLabel = "(no label)"
)

// kdfArgs select the key derivation for every keyslot this package writes. Berth's keys are 32-byte random or
// HKDF-derived values, not passwords: stretching a 256-bit key buys nothing, while the default argon2id would
// take about 1 GiB of RAM and seconds of CPU for each keyslot operation, at every boot of every node. PBKDF2
// with a fixed, small iteration count keeps unlock fast and its cost predictable on small machines.
var kdfArgs = []string{"--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"}

// cryptsetup exit codes, from cryptsetup(8).
const (
	exitInvalid  = 1 // wrong parameters; also what isLuks returns for a device that is not LUKS
	exitWrongKey = 2 // no permission or bad passphrase
)

// Volume is one LUKS2 volume, addressed by the path of its block device or image file.
type Volume struct {
	path       string
	cryptsetup string
	logger     *slog.Logger
}

// Option configures a Volume.
type Option func(*Volume)

// WithCryptsetup runs the given cryptsetup binary instead of looking cryptsetup up on PATH.
func WithCryptsetup(path string) Option {
	return func(v *Volume) { v.cryptsetup = path }
}

// New returns the volume at path. Nothing is checked until a method is called; cryptsetup is looked up on
// PATH at each use, so a Volume can be made before the tool is installed.
func New(path string, logger *slog.Logger, opts ...Option) *Volume {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	v := &Volume{path: path, logger: logger}
	for _, o := range opts {
		o(v)
	}
	return v
}

// Path returns the path of the volume's device.
func (v *Volume) Path() string { return v.path }

// IsLUKS reports whether the device carries a LUKS header. A device that exists but holds anything else
// (zeros, a filesystem) is not an error: it reports false.
func (v *Volume) IsLUKS(ctx context.Context) (bool, error) {
	_, err := v.run(ctx, nil, nil, "isLuks", v.path)
	var ce *cmdError
	switch {
	case err == nil:
		return true, nil
	case errors.As(err, &ce) && ce.exitCode == exitInvalid:
		return false, nil
	default:
		return false, fmt.Errorf("checking %s for a LUKS header: %w", v.path, err)
	}
}

// Format makes the device a new LUKS2 volume whose only keyslot holds key, with the given label (none if
// empty). Whatever the device held before is lost.
func (v *Volume) Format(ctx context.Context, key []byte, label string) error {
	if err := checkNewKey(key); err != nil {
		return fmt.Errorf("formatting %s: %w", v.path, err)
	}
	if err := checkLabel(label); err != nil {
		return fmt.Errorf("formatting %s: %w", v.path, err)
	}
	args := []string{"luksFormat", "--type", "luks2", "--batch-mode",
		"--cipher", "aes-xts-plain64", "--key-size", "512", "--luks2-metadata-size", metadataSize, "--key-file=-"}
	args = append(args, kdfArgs...)
	if label != "" {
		args = append(args, "--label", label)
	}
	if _, err := v.run(ctx, key, nil, append(args, v.path)...); err != nil {
		return fmt.Errorf("formatting %s: %w", v.path, err)
	}
	v.logger.Info("luks volume formatted", "device", v.path, "label", label)
	return nil
}

// UUID returns the volume's UUID in canonical form (lowercase, hyphenated).
func (v *Volume) UUID(ctx context.Context) (string, error) {
	out, err := v.run(ctx, nil, nil, "luksUUID", v.path)
	if err != nil {
		return "", fmt.Errorf("reading the UUID of %s: %w", v.path, err)
	}
	s := strings.TrimSpace(out)
	id, err := uuid.Parse(s)
	if err != nil {
		return "", fmt.Errorf("reading the UUID of %s: cryptsetup printed %q: %w", v.path, s, err)
	}
	return id.String(), nil
}

// Label returns the volume's LUKS2 label, empty if it has none.
func (v *Volume) Label(ctx context.Context) (string, error) {
	out, err := v.run(ctx, nil, nil, "luksDump", v.path)
	if err != nil {
		return "", fmt.Errorf("reading the label of %s: %w", v.path, err)
	}
	for line := range strings.Lines(out) {
		value, ok := strings.CutPrefix(line, "Label:")
		if !ok {
			continue
		}
		value = strings.TrimSpace(value)
		if value == noLabel {
			return "", nil
		}
		return value, nil
	}
	return "", fmt.Errorf("reading the label of %s: luksDump printed no Label line", v.path)
}

// SetLabel replaces the volume's LUKS2 label; an empty label removes it.
func (v *Volume) SetLabel(ctx context.Context, label string) error {
	if err := checkLabel(label); err != nil {
		return fmt.Errorf("labelling %s: %w", v.path, err)
	}
	if _, err := v.run(ctx, nil, nil, "config", "--label", label, v.path); err != nil {
		return fmt.Errorf("labelling %s: %w", v.path, err)
	}
	v.logger.Info("luks volume labelled", "device", v.path, "label", label)
	return nil
}

var unlockedRE = regexp.MustCompile(`(?m)^Key slot (\d+) unlocked\.`)

// KeySlot returns the keyslot that key opens, or an error wrapping ErrWrongKey if it opens none. It checks
// the key as opening the volume would, without creating a mapping, so it works where dm-crypt is missing.
func (v *Volume) KeySlot(ctx context.Context, key []byte) (int, error) {
	if len(key) == 0 {
		return 0, fmt.Errorf("testing a key on %s: the key is empty", v.path)
	}
	out, err := v.run(ctx, key, nil, "open", "--test-passphrase", "--type", "luks2", "--verbose", "--key-file=-", v.path)
	if err != nil {
		return 0, fmt.Errorf("testing a key on %s: %w", v.path, keyErr(err))
	}
	m := unlockedRE.FindStringSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("testing a key on %s: cryptsetup accepted the key but named no keyslot", v.path)
	}
	slot, err := strconv.Atoi(m[1])
	if err != nil {
		return 0, fmt.Errorf("testing a key on %s: keyslot %q: %w", v.path, m[1], err)
	}
	return slot, nil
}

// Slots returns the volume's active keyslots in ascending order.
func (v *Volume) Slots(ctx context.Context) ([]int, error) {
	meta, err := v.metadata(ctx)
	if err != nil {
		return nil, fmt.Errorf("listing the keyslots of %s: %w", v.path, err)
	}
	slots, err := numbered(meta.Keyslots, maxSlot)
	if err != nil {
		return nil, fmt.Errorf("listing the keyslots of %s: LUKS2 metadata names keyslot %w", v.path, err)
	}
	return slots, nil
}

// Token is one LUKS2 token: a JSON object in the volume's header that cryptsetup keeps beside the keyslots
// without interpreting it (for a type it does not know).
type Token struct {
	ID   int
	Type string
	// JSON is the token's whole object, as stored.
	JSON []byte
}

// Tokens returns the volume's tokens of type typ, in ascending id order.
func (v *Volume) Tokens(ctx context.Context, typ string) ([]Token, error) {
	meta, err := v.metadata(ctx)
	if err != nil {
		return nil, fmt.Errorf("listing the tokens of %s: %w", v.path, err)
	}
	ids, err := numbered(meta.Tokens, maxToken)
	if err != nil {
		return nil, fmt.Errorf("listing the tokens of %s: LUKS2 metadata names token %w", v.path, err)
	}
	var tokens []Token
	for _, id := range ids {
		raw := meta.Tokens[strconv.Itoa(id)]
		var head struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(raw, &head); err != nil {
			return nil, fmt.Errorf("listing the tokens of %s: token %d: %w", v.path, id, err)
		}
		if head.Type == typ {
			tokens = append(tokens, Token{ID: id, Type: head.Type, JSON: raw})
		}
	}
	return tokens, nil
}

// AddToken stores token, a JSON object with a "type" and a "keyslots" array, under the lowest free token
// id, which it returns. No key is needed: a token is metadata. cryptsetup writes the LUKS2 header's two
// copies one after the other, each with its sequence number, so a crash leaves the token wholly stored
// or not at all.
func (v *Volume) AddToken(ctx context.Context, token []byte) (int, error) {
	if len(token) > MaxTokenSize {
		return 0, fmt.Errorf("adding a token to %s: the token is %d bytes, at most %d fit the LUKS2 header", v.path, len(token), MaxTokenSize)
	}
	meta, err := v.metadata(ctx)
	if err != nil {
		return 0, fmt.Errorf("adding a token to %s: %w", v.path, err)
	}
	id := -1
	for i := 0; i <= maxToken; i++ {
		if _, used := meta.Tokens[strconv.Itoa(i)]; !used {
			id = i
			break
		}
	}
	if id < 0 {
		return 0, fmt.Errorf("adding a token to %s: all %d token ids are used", v.path, maxToken+1)
	}
	if _, err := v.run(ctx, token, nil, "token", "import", "--json-file", "-", "--token-id", strconv.Itoa(id), v.path); err != nil {
		return 0, fmt.Errorf("adding a token to %s: %w", v.path, err)
	}
	v.logger.Info("luks token added", "device", v.path, "token", id)
	return id, nil
}

// RemoveToken removes the token with the given id.
func (v *Volume) RemoveToken(ctx context.Context, id int) error {
	if id < 0 || id > maxToken {
		return fmt.Errorf("removing token %d of %s: LUKS2 tokens are numbered 0 to %d", id, v.path, maxToken)
	}
	if _, err := v.run(ctx, nil, nil, "token", "remove", "--token-id", strconv.Itoa(id), v.path); err != nil {
		return fmt.Errorf("removing token %d of %s: %w", id, v.path, err)
	}
	v.logger.Info("luks token removed", "device", v.path, "token", id)
	return nil
}

// header is the part of the LUKS2 JSON metadata this package reads.
type header struct {
	Keyslots map[string]json.RawMessage `json:"keyslots"`
	Tokens   map[string]json.RawMessage `json:"tokens"`
}

func (v *Volume) metadata(ctx context.Context) (*header, error) {
	out, err := v.run(ctx, nil, nil, "luksDump", "--dump-json-metadata", v.path)
	if err != nil {
		return nil, err
	}
	var meta header
	if err := json.Unmarshal([]byte(out), &meta); err != nil {
		return nil, fmt.Errorf("parsing LUKS2 metadata: %w", err)
	}
	return &meta, nil
}

// numbered returns the keys of m, which LUKS2 numbers 0 to highest, in ascending order.
func numbered(m map[string]json.RawMessage, highest int) ([]int, error) {
	ids := make([]int, 0, len(m))
	for name := range m {
		n, err := strconv.Atoi(name)
		if err != nil || n < 0 || n > highest {
			return nil, fmt.Errorf("%q", name)
		}
		ids = append(ids, n)
	}
	slices.Sort(ids)
	return ids, nil
}

// AddKey puts newKey into a free keyslot, authorized by existing, a key that already opens the volume.
func (v *Volume) AddKey(ctx context.Context, existing, newKey []byte) error {
	if len(existing) == 0 {
		return fmt.Errorf("adding a key to %s: the authorizing key is empty", v.path)
	}
	if err := checkNewKey(newKey); err != nil {
		return fmt.Errorf("adding a key to %s: %w", v.path, err)
	}
	args := append([]string{"luksAddKey", "--batch-mode", "--key-file=-"}, kdfArgs...)
	// The new key is the positional key file, the first of cmd.ExtraFiles. /proc/self/fd rather than
	// /dev/fd: a minimal system (an initrd, the local node image) has /proc but no /dev/fd link, which
	// only udev or systemd makes.
	if _, err := v.run(ctx, existing, newKey, append(args, v.path, "/proc/self/fd/3")...); err != nil {
		return fmt.Errorf("adding a key to %s: %w", v.path, keyErr(err))
	}
	v.logger.Info("luks key added", "device", v.path)
	return nil
}

// KillSlot wipes a keyslot. auth must open one of the keyslots that remain, so a volume never loses its last
// working key: cryptsetup refuses a key that opens only the slot being wiped, except when that slot is the
// last one (in batch mode it would wipe it), which KillSlot refuses itself.
func (v *Volume) KillSlot(ctx context.Context, slot int, auth []byte) error {
	if slot < 0 || slot > maxSlot {
		return fmt.Errorf("wiping keyslot %d of %s: LUKS2 keyslots are numbered 0 to %d", slot, v.path, maxSlot)
	}
	if len(auth) == 0 {
		return fmt.Errorf("wiping keyslot %d of %s: the authorizing key is empty", slot, v.path)
	}
	slots, err := v.Slots(ctx)
	if err != nil {
		return fmt.Errorf("wiping keyslot %d: %w", slot, err)
	}
	if !slices.Contains(slots, slot) {
		return fmt.Errorf("wiping keyslot %d of %s: the keyslot is not active", slot, v.path)
	}
	if len(slots) == 1 {
		return fmt.Errorf("wiping keyslot %d of %s: it is the last keyslot, the volume would be lost", slot, v.path)
	}
	if _, err := v.run(ctx, auth, nil, "luksKillSlot", "--batch-mode", "--key-file=-", v.path, strconv.Itoa(slot)); err != nil {
		return fmt.Errorf("wiping keyslot %d of %s: %w", slot, v.path, keyErr(err))
	}
	v.logger.Info("luks keyslot wiped", "device", v.path, "slot", slot)
	return nil
}

// Open unlocks the volume with key and maps it as /dev/mapper/<name>, which it returns. It needs dm-crypt in
// the kernel and the right to use it.
func (v *Volume) Open(ctx context.Context, key []byte, name string) (string, error) {
	if err := checkMapperName(name); err != nil {
		return "", fmt.Errorf("opening %s: %w", v.path, err)
	}
	if len(key) == 0 {
		return "", fmt.Errorf("opening %s: the key is empty", v.path)
	}
	if _, err := v.run(ctx, key, nil, "open", "--type", "luks2", "--key-file=-", v.path, name); err != nil {
		return "", fmt.Errorf("opening %s as %s: %w", v.path, name, keyErr(err))
	}
	device := mapperDir + name
	v.logger.Info("luks volume opened", "device", v.path, "mapping", device)
	return device, nil
}

// Close removes the mapping /dev/mapper/<name> that Open made.
func (v *Volume) Close(ctx context.Context, name string) error {
	if err := checkMapperName(name); err != nil {
		return fmt.Errorf("closing a mapping: %w", err)
	}
	if _, err := v.run(ctx, nil, nil, "close", name); err != nil {
		return fmt.Errorf("closing %s: %w", name, err)
	}
	v.logger.Info("luks volume closed", "mapping", mapperDir+name)
	return nil
}

func checkNewKey(key []byte) error {
	if len(key) < MinKeySize || len(key) > MaxKeySize {
		return fmt.Errorf("the new key is %d bytes, want %d to %d random bytes", len(key), MinKeySize, MaxKeySize)
	}
	return nil
}

// checkLabel keeps labels to characters that luksDump prints back unchanged on one line, so Label can read
// back exactly what SetLabel wrote.
func checkLabel(label string) error {
	if len(label) > MaxLabelSize {
		return fmt.Errorf("label %q is %d bytes, LUKS2 holds at most %d", label, len(label), MaxLabelSize)
	}
	for _, r := range label {
		if !isNameChar(r) {
			return fmt.Errorf("label %q has a character other than letters, digits, '.', '_', '-'", label)
		}
	}
	return nil
}

// checkMapperName accepts device-mapper names that are also safe as file names under /dev/mapper.
func checkMapperName(name string) error {
	if name == "" || name == "." || name == ".." || len(name) > 127 {
		return fmt.Errorf("mapping name %q must be 1 to 127 characters and not . or ..", name)
	}
	for _, r := range name {
		if !isNameChar(r) {
			return fmt.Errorf("mapping name %q has a character other than letters, digits, '.', '_', '-'", name)
		}
	}
	return nil
}

func isNameChar(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-'
}

// cmdError is a failed cryptsetup run. It carries cryptsetup's stderr, which names devices and reasons but
// never key material, since keys only ever reach cryptsetup through file descriptors.
type cmdError struct {
	action   string
	exitCode int
	stderr   string
	err      error
}

func (e *cmdError) Error() string {
	msg := fmt.Sprintf("cryptsetup %s: %v", e.action, e.err)
	if e.stderr != "" {
		msg += ": " + e.stderr
	}
	return msg
}

func (e *cmdError) Unwrap() error { return e.err }

// run runs cryptsetup with args, feeding stdin to its standard input and, if extra is not nil, extra to the
// read end of a pipe that it inherits as file descriptor 3. It returns cryptsetup's standard output, or a
// *cmdError.
func (v *Volume) run(ctx context.Context, stdin, extra []byte, args ...string) (string, error) {
	bin := v.cryptsetup
	if bin == "" {
		var err error
		if bin, err = exec.LookPath("cryptsetup"); err != nil {
			return "", fmt.Errorf("cryptsetup not found on PATH (install the cryptsetup package): %w", err)
		}
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	// cryptsetup translates its messages; KeySlot and Label parse them.
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	if extra != nil {
		r, err := pipeWith(extra)
		if err != nil {
			return "", fmt.Errorf("cryptsetup %s: %w", args[0], err)
		}
		defer r.Close()
		cmd.ExtraFiles = []*os.File{r}
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	v.logger.Debug("running cryptsetup", "action", args[0], "device", v.path)
	err := cmd.Run()
	if err == nil {
		return stdout.String(), nil
	}
	ce := &cmdError{action: args[0], exitCode: -1, stderr: strings.TrimSpace(stderr.String()), err: err}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		ce.exitCode = ee.ExitCode()
	}
	return "", ce
}

// keyErr marks a failure of a command that was given a key as ErrWrongKey when cryptsetup says that the key
// opens nothing.
func keyErr(err error) error {
	var ce *cmdError
	if errors.As(err, &ce) && ce.exitCode == exitWrongKey {
		return fmt.Errorf("%w: %w", ErrWrongKey, err)
	}
	return err
}

// pipeWith returns the read end of a pipe that holds data and then ends. data is far smaller than a pipe's
// buffer, so it is written whole before the reader starts, and never passes through a file.
func pipeWith(data []byte) (*os.File, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("making a pipe for a key: %w", err)
	}
	_, werr := w.Write(data)
	cerr := w.Close()
	if err := errors.Join(werr, cerr); err != nil {
		r.Close()
		return nil, fmt.Errorf("writing a key into a pipe: %w", err)
	}
	return r, nil
}

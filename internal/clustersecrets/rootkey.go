package clustersecrets

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
)

// maxRootKeyText bounds the text decoded, so a file passed by mistake is refused before it is copied around.
const maxRootKeyText = 4096

// rootKeyHint tells operators how to make a root key; it appears in errors, never with the value given.
const rootKeyHint = "make one with: head -c 32 /dev/urandom | base64"

// ParseRootKey decodes a root key written in base64, with the standard or the URL-safe alphabet, padded or
// not; whitespace around it (a trailing newline from file()) is ignored. Errors never contain the text.
func ParseRootKey(text string) ([]byte, error) {
	text = strings.TrimSpace(text)
	if text == "" {
		return nil, errors.New("the root key is empty; " + rootKeyHint)
	}
	if len(text) > maxRootKeyText {
		return nil, fmt.Errorf("the root key is %d characters long, more than %d: is it really a base64 key?", len(text), maxRootKeyText)
	}
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		root, err := enc.DecodeString(text)
		if err != nil {
			continue
		}
		if len(root) < MinRootKeySize {
			return nil, fmt.Errorf("the root key decodes to %d bytes, want at least %d random bytes; %s",
				len(root), MinRootKeySize, rootKeyHint)
		}
		return root, nil
	}
	return nil, errors.New("the root key is not base64 (standard or URL-safe alphabet, padded or not); " + rootKeyHint)
}

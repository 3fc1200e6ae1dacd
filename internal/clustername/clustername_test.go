package clustername

import (
	"strings"
	"testing"
)

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name, wantErr string
	}{
		{"lab", ""},
		{"berth-prod-1", ""},
		{strings.Repeat("a", 63), ""},
		{"", "cluster name is empty"},
		{strings.Repeat("a", 64), "must be no more than 63 characters"},
		{"Lab_1", `cluster name "Lab_1" is not a DNS-1123 label`},
		{"berth.example", "is not a DNS-1123 label"},
		{"-lab", "is not a DNS-1123 label"},
	} {
		err := Validate(tc.name)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("Validate(%q) = %v, want nil", tc.name, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("Validate(%q) = %v, want an error containing %q", tc.name, err, tc.wantErr)
		}
	}
}

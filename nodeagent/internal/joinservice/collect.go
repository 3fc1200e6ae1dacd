package joinservice

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berthlabs/berth/internal/diskrecord"
	"github.com/berthlabs/berth/internal/metadata"
)

// DefaultRetention is how long the disk record of an instance that is gone is kept: long enough for a
// stopped instance, which a cloud's API no longer lists as running, to be started again over a weekend and
// still get its rejoin ticket.
const DefaultRetention = 72 * time.Hour

// Collect removes the disk records of instances that are gone: a record whose instance the lookup no longer
// finds at its addresses (or finds under another name) is marked absent, and removed once it has been absent
// for retention on every sweep since; an instance found again clears the mark. A lookup that fails marks
// nothing. Bootstrap tokens need no collecting: they expire minutes after they were made. It returns the
// disks whose records it removed.
func (k *KubeDisks) Collect(ctx context.Context, lookup InstanceLookup, retention time.Duration, now time.Time) ([]string, error) {
	records, err := k.Client.CoreV1().ConfigMaps(Namespace).List(ctx, metav1.ListOptions{LabelSelector: instanceLabel})
	if err != nil {
		return nil, fmt.Errorf("listing disk records: %w", err)
	}
	var removed []string
	var errs []error
	for _, r := range records.Items {
		if !strings.HasPrefix(r.Name, diskrecord.Prefix) {
			continue
		}
		disk := strings.TrimPrefix(r.Name, diskrecord.Prefix)
		present, err := instancePresent(ctx, lookup, r.Annotations[instanceNameAnnotation], r.Annotations[instanceAddressesAnnotation])
		if err != nil {
			errs = append(errs, fmt.Errorf("disk %s: %w", disk, err))
			continue
		}
		since, marked := r.Annotations[absentSinceAnnotation]
		switch {
		case present && !marked:
		case present:
			delete(r.Annotations, absentSinceAnnotation)
			_, err = k.Client.CoreV1().ConfigMaps(Namespace).Update(ctx, &r, metav1.UpdateOptions{})
		case !marked:
			r.Annotations[absentSinceAnnotation] = now.UTC().Format(time.RFC3339)
			_, err = k.Client.CoreV1().ConfigMaps(Namespace).Update(ctx, &r, metav1.UpdateOptions{})
		default:
			t, perr := time.Parse(time.RFC3339, since)
			if perr == nil && now.Sub(t) < retention {
				continue
			}
			// The record is removed only as it was read: an instance that joined again meanwhile updated it.
			err = k.Client.CoreV1().ConfigMaps(Namespace).Delete(ctx, r.Name, metav1.DeleteOptions{
				Preconditions: &metav1.Preconditions{ResourceVersion: &r.ResourceVersion}})
			if err == nil {
				removed = append(removed, disk)
			}
		}
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			errs = append(errs, fmt.Errorf("disk %s: %w", disk, err))
		}
	}
	return removed, errors.Join(errs...)
}

// instancePresent reports whether the instance name still has one of the addresses.
func instancePresent(ctx context.Context, lookup InstanceLookup, name, addresses string) (bool, error) {
	if name == "" || addresses == "" {
		return false, errors.New("the record names no instance or address")
	}
	for a := range strings.SplitSeq(addresses, ",") {
		addr, err := netip.ParseAddr(a)
		if err != nil {
			return false, fmt.Errorf("address %q: %w", a, err)
		}
		inst, err := lookup.InstanceByAddress(ctx, addr)
		switch {
		case errors.Is(err, metadata.ErrNotFound):
		case err != nil:
			return false, err
		case inst.Name == name:
			return true, nil
		}
	}
	return false, nil
}

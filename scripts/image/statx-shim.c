/*
 * Preloaded in every sandbox image (/etc/ld.so.preload): statx() without
 * AT_NO_AUTOMOUNT.
 *
 * Debian 12's coreutils (ls -l, stat, du, ...) call
 * statx(..., AT_STATX_SYNC_AS_STAT | AT_NO_AUTOMOUNT, ...); the runsc Debian
 * 12 ships (release 20220425) answers EINVAL to AT_NO_AUTOMOUNT ("Invalid
 * argument" for every path), fixed upstream on 2023-02-21 (gVisor 7a0c4b574,
 * "Ignore AT_NO_AUTOMOUNT flag in statx() calls"). gVisor has no automount
 * points, so the flag never changes a result: dropping it is exact. A newer
 * runsc ignores it itself; the shim then changes nothing.
 *
 * Built by scripts/build-image.sh with the host's compiler (the image and the
 * build host are both Debian 12, same glibc).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}

/* disk_tier.c: Buffers backed by a file, for offloading state to disk.
 *
 * Each disk Buffer is its own file in a directory the caller names, mapped
 * shared into memory, so kernels and copies see plain host memory while the
 * kernel's page cache and the file hold the bytes. The file's blocks are
 * reserved up front (posix_fallocate): a full disk is an OSError at
 * allocation, never a SIGBUS at some later write. The name is removed as
 * soon as the file is mapped: the open file and the mapping keep its blocks,
 * so nothing is left on disk when the buffer is freed or the process dies,
 * however it ends (a killed process left its named files behind).
 *
 * Names carry 128 random bits from getrandom(), and files are created with
 * O_EXCL | O_NOFOLLOW and mode 0600: in a shared directory another user can
 * neither guess a name in advance nor redirect one through a planted link.
 */
#include "rlhfz_module.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define NAME_RANDOM_BYTES 16
/* a name taken by someone else is skipped; this many in a row is no accident */
#define NAME_ATTEMPTS 64

/* Writes "<dir>/rlhfz-<32 hex digits>.buf" into name; 0, or an errno. */
static int random_name(char *name, size_t length, const char *dir)
{
    unsigned char bytes[NAME_RANDOM_BYTES];
    size_t filled = 0;
    while (filled < sizeof(bytes)) {
        ssize_t got = getrandom(bytes + filled, sizeof(bytes) - filled, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        filled += (size_t)got;
    }
    char hex[2 * NAME_RANDOM_BYTES + 1];
    for (size_t i = 0; i < sizeof(bytes); i++)
        snprintf(hex + 2 * i, 3, "%02x", bytes[i]);
    snprintf(name, length, "%s/rlhfz-%s.buf", dir, hex);
    return 0;
}

int rlhfz_disk_alloc(const char *dir, size_t nbytes, void **data, int *fd, char **path)
{
    *data = NULL;
    *fd = -1;
    *path = NULL;
    size_t length = strlen(dir) + 64;
    char *name = malloc(length);
    if (name == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    snprintf(name, length, "%s/rlhfz-<random>.buf", dir);    /* for errors before a name is drawn */
    int error = 0;
    const char *step = "open";
    void *mapped = MAP_FAILED;
    int file = -1;
    Py_BEGIN_ALLOW_THREADS
    for (int attempt = 0; attempt < NAME_ATTEMPTS; attempt++) {
        error = random_name(name, length, dir);
        if (error != 0) {
            step = "draw a random name for";
            break;
        }
        /* O_EXCL: never an existing file, nor a link planted at the name */
        file = open(name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        error = file < 0 ? errno : 0;
        if (error != EEXIST)
            break;
    }
    if (file >= 0) {
        step = "reserve";
        error = posix_fallocate(file, 0, (off_t)nbytes);
        if (error == 0) {
            step = "map";
            mapped = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, file, 0);
            if (mapped == MAP_FAILED)
                error = errno;
        }
        if (error == 0) {
            step = "unlink";
            if (unlink(name) != 0) {
                error = errno;
                munmap(mapped, nbytes);
                mapped = MAP_FAILED;
            }
        }
        if (error != 0) {
            close(file);
            unlink(name);
        }
    }
    Py_END_ALLOW_THREADS
    if (error != 0) {
        char message[1024];
        snprintf(message, sizeof(message), "could not %s a %zu-byte disk buffer at %s: %s", step,
                 nbytes, name, strerror(error));
        /* OSError(errno, text) picks the subclass (PermissionError, ...) */
        /* a path is bytes in the file system's encoding, not always UTF-8 */
        PyObject *text = PyUnicode_DecodeFSDefault(message);
        PyObject *exception = text == NULL ? NULL
                              : PyObject_CallFunction(PyExc_OSError, "iN", error, text);
        if (exception != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exception), exception);
            Py_DECREF(exception);
        }
        free(name);
        return -1;
    }
    *data = mapped;
    *fd = file;
    *path = name;
    return 0;
}

void rlhfz_disk_free(void *data, size_t nbytes, int fd, char *path)
{
    /* the name went at allocation: the blocks go with the last reference */
    if (data != NULL)
        munmap(data, nbytes);
    if (fd >= 0)
        close(fd);
    free(path);
}

int rlhfz_disk_release_pages(void *data, size_t nbytes)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    /* Shared file pages leave this process (its RSS); the data stays in the
     * page cache and the file, and faults back in on the next access. */
    rc = madvise(data, nbytes, MADV_DONTNEED);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

int rlhfz_disk_check(int fd, size_t nbytes, const char *path)
{
    struct stat info;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fstat(fd, &info);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    /* A page past the end of a shortened file is a SIGBUS, not an error */
    if ((unsigned long long)info.st_size < (unsigned long long)nbytes) {
        PyObject *name = PyUnicode_DecodeFSDefault(path != NULL ? path : "?");
        if (name != NULL) {
            PyErr_Format(PyExc_OSError, "the disk buffer's file %U has %lld bytes, not its %zu: "
                         "something outside rlhfz shortened it, and the bytes past its end "
                         "are gone; nothing was read or written", name, (long long)info.st_size, nbytes);
            Py_DECREF(name);
        }
        return -1;
    }
    return 0;
}

int rlhfz_buffer_intact(const rlhfz_Buffer *buffer)
{
    if (buffer->tier != RLHFZ_TIER_DISK)
        return 0;
    return rlhfz_disk_check(buffer->fd, buffer->mapped, buffer->path);
}

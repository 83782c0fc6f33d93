/* disk_tier.c: Buffers backed by a file, for offloading state to disk.
 *
 * Each disk Buffer is its own file in a directory the caller names, mapped
 * shared into memory, so kernels and copies see plain host memory while the
 * kernel's page cache and the file hold the bytes. The file's blocks are
 * reserved up front (posix_fallocate): a full disk is an OSError at
 * allocation, never a SIGBUS at some later write. Freeing unmaps, closes
 * and deletes the file.
 */
#include "rlhfz_module.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static atomic_ulong file_counter;

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
    snprintf(name, length, "%s/rlhfz-%ld-%lu.buf", dir, (long)getpid(),
             (unsigned long)atomic_fetch_add(&file_counter, 1));
    int error = 0;
    const char *step = "open";
    void *mapped = MAP_FAILED;
    int file;
    Py_BEGIN_ALLOW_THREADS
    file = open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (file < 0) {
        error = errno;
    } else {
        step = "reserve";
        error = posix_fallocate(file, 0, (off_t)nbytes);
        if (error == 0) {
            step = "map";
            mapped = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, file, 0);
            if (mapped == MAP_FAILED)
                error = errno;
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
        PyObject *exception = PyObject_CallFunction(PyExc_OSError, "is", error, message);
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
    if (data != NULL)
        munmap(data, nbytes);
    if (fd >= 0)
        close(fd);
    if (path != NULL) {
        unlink(path);
        free(path);
    }
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

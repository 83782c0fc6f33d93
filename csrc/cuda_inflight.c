/* cuda_inflight.c: the borrowed arrays a queued kernel still reads.
 *
 * A CUDA entry point returns once its kernel is queued; the kernel reads
 * its arrays later. An rlhfz view keeps its Buffer alive, and freeing a
 * Buffer's device memory waits for the device anyway. A tensor borrowed
 * through DLPack (torch's, say) is another matter: let go at once, its
 * memory may go back to torch's caching allocator and be handed out again,
 * to a tensor used on another stream, while the kernel still reads it. So
 * such borrows are kept behind an event recorded after the launch, and let
 * go once the event is done: looked at before every launch. The events are
 * reused.
 */
#include "rlhfz_module.h"

#include <stdlib.h>

#ifdef RLHFZ_WITH_CUDA
#include "rlhfz_cuda.h"
#endif

typedef struct inflight_entry {
    void *event;
    int device;
    PyObject *keep[RLHFZ_MAX_BORROWED];
    int count;
    struct inflight_entry *next;
} inflight_entry;

struct rlhfz_inflight {
    inflight_entry *pending;     /* newest first */
    inflight_entry *spare;       /* entries whose events may be recorded again */
};

rlhfz_inflight *rlhfz_inflight_new(void)
{
    rlhfz_inflight *inflight = calloc(1, sizeof(*inflight));
    if (inflight == NULL)
        PyErr_NoMemory();
    return inflight;
}

int rlhfz_inflight_needed(const rlhfz_borrowed *b)
{
    for (int i = 0; i < b->count; i++)
        if (b->items[i].keepalive != NULL && PyCapsule_CheckExact(b->items[i].keepalive))
            return 1;
    return 0;
}

void *rlhfz_inflight_spare_event(rlhfz_inflight *inflight, int device)
{
    for (inflight_entry **link = &inflight->spare; *link != NULL; link = &(*link)->next) {
        inflight_entry *entry = *link;
        if (entry->device == device) {
            *link = entry->next;
            void *event = entry->event;
            free(entry);
            return event;
        }
    }
    return NULL;
}

static void release(inflight_entry *entry)
{
    for (int i = 0; i < entry->count; i++) {
        rlhfz_borrow_end(entry->keep[i]);
        Py_CLEAR(entry->keep[i]);
    }
    entry->count = 0;
}

int rlhfz_inflight_keep(rlhfz_inflight *inflight, rlhfz_borrowed *b, void *event, int device)
{
    inflight_entry *entry = calloc(1, sizeof(*entry));
    if (entry == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    entry->event = event;
    entry->device = device;
    for (int i = 0; i < b->count; i++) {
        PyObject *keep = b->items[i].keepalive;
        if (keep != NULL && PyCapsule_CheckExact(keep)) {
            entry->keep[entry->count++] = keep;      /* the reference moves here */
            b->items[i].keepalive = NULL;
        }
    }
    entry->next = inflight->pending;
    inflight->pending = entry;
    return 0;
}

#ifdef RLHFZ_WITH_CUDA
int rlhfz_inflight_fence(void **event, void *stream)
{
    rlhfz_status status = *event != NULL ? RLHFZ_OK : rlhfz_cuda_event_create(event);
    if (status == RLHFZ_OK)
        status = rlhfz_cuda_event_record(*event, stream);
    if (status == RLHFZ_OK)
        return 1;
    /* no event to wait behind: wait for the work here */
    (void)rlhfz_cuda_stream_synchronize(stream);
    return 0;
}

void rlhfz_inflight_settle(rlhfz_inflight *inflight, rlhfz_borrowed *b, void *event, int device,
                           int kept)
{
    if (kept && rlhfz_inflight_keep(inflight, b, event, device) < 0) {
        /* no memory to keep them: the work is queued, so wait for it here */
        PyErr_Clear();
        Py_BEGIN_ALLOW_THREADS
        (void)rlhfz_cuda_event_synchronize(event);
        Py_END_ALLOW_THREADS
        kept = 0;
    }
    if (!kept && event != NULL)
        rlhfz_cuda_event_destroy(event);
}
#endif

/* Whether the kernel behind the entry is done; a failing query (a lost
 * context) counts as done: nothing will run any more. */
static int finished(inflight_entry *entry)
{
#ifdef RLHFZ_WITH_CUDA
    int done = 1;
    rlhfz_status status = rlhfz_cuda_event_query(entry->event, &done);
    return status != RLHFZ_OK || done;
#else
    (void)entry;
    return 1;
#endif
}

void rlhfz_inflight_sweep(rlhfz_inflight *inflight)
{
    if (inflight == NULL)
        return;
    inflight_entry **link = &inflight->pending;
    while (*link != NULL) {
        inflight_entry *entry = *link;
        if (!finished(entry)) {
            link = &entry->next;
            continue;
        }
        *link = entry->next;
        release(entry);
        entry->next = inflight->spare;
        inflight->spare = entry;
    }
}

void rlhfz_inflight_free(rlhfz_inflight *inflight)
{
    if (inflight == NULL)
        return;
    /* The module goes (at exit, usually): what is still running keeps its
     * borrows, leaked rather than waited for (a stream may never finish). */
    rlhfz_inflight_sweep(inflight);
    while (inflight->spare != NULL) {
        inflight_entry *entry = inflight->spare;
        inflight->spare = entry->next;
#ifdef RLHFZ_WITH_CUDA
        rlhfz_cuda_event_destroy(entry->event);
#endif
        free(entry);
    }
    free(inflight);
}

/* device_memory.cpp: device memory the host cannot touch, and page-locked
 * host memory.
 *
 * Each device owns a large PROT_NONE reservation of address space. A
 * cudaMalloc'd pointer lies inside it, so a host dereference faults as it
 * would on a GPU; the simulator itself reads and writes the bytes through a
 * second, read-write mapping of a memfd (the alias), whose data sits against
 * a PROT_NONE guard page (its start kept 256-byte aligned, as cudaMalloc's),
 * so an overrun past the allocation's last 256-byte unit faults too. New allocations are
 * filled with 0xFF bytes (NaN as floats): reading memory before writing it
 * shows. Freed addresses are not handed out again until the reservation
 * wraps, so a stale pointer is reported as freed rather than silently
 * landing in a newer allocation. Capacity is RLHFZ_SIM_DEVICE_BYTES, and
 * cudaMemGetInfo counts every byte of it exactly (allocations are charged
 * in whole 512-byte units, as the driver rounds).
 */
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include "state.h"

namespace cudasim {
namespace {

constexpr std::size_t CHARGE_UNIT = 512;
constexpr std::size_t VIEW_ALIGN = 512;

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

std::size_t page_size()
{
    static const std::size_t size = (std::size_t)sysconf(_SC_PAGESIZE);
    return size;
}

struct Allocation {
    std::uintptr_t view;        /* what cudaMalloc handed out */
    std::size_t size;
    char *alias;                /* the same bytes, readable and writable by the host */
    char *mapping;              /* the alias's mapping (with its guard page) */
    std::size_t mapping_bytes;
    std::size_t charged;
    int device;
};

struct DeviceSpace {
    std::uintptr_t start = 0, end = 0;   /* the reservation */
    std::uintptr_t cursor = 0;           /* where the next allocation is tried */
    std::size_t used = 0;                /* charged bytes */
};

struct PinnedRange {
    std::size_t size;
    bool registered;            /* cudaHostRegister, not cudaHostAlloc */
};

struct Memory {
    std::mutex mutex;
    std::vector<DeviceSpace> devices;
    std::map<std::uintptr_t, Allocation> by_view;
    std::map<std::uintptr_t, std::uintptr_t> view_by_alias;
    std::map<std::uintptr_t, PinnedRange> pinned;
    std::size_t pinned_bytes = 0;
};

Memory &memory()
{
    static Memory *state = [] {
        Memory *m = new Memory;
        const Config &c = config();
        m->devices.resize((std::size_t)c.devices);
        /* 16x the capacity of address space: freed addresses rest a long while */
        std::size_t reserve = round_up(c.device_bytes, page_size()) * 16;
        for (DeviceSpace &space : m->devices) {
            void *base = mmap(nullptr, reserve, PROT_NONE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (base == MAP_FAILED)
                continue;          /* this device can allocate nothing */
            space.start = space.cursor = (std::uintptr_t)base;
            space.end = space.start + reserve;
        }
        return m;
    }();
    return *state;
}

/* A free stretch of `bytes` in the device's reservation (with one unit of
 * gap to the next allocation), first after the cursor, then from the start. */
std::uintptr_t place(Memory &m, DeviceSpace &space, std::size_t bytes)
{
    std::size_t needed = bytes + VIEW_ALIGN;
    for (int pass = 0; pass < 2; pass++) {
        std::uintptr_t at = pass == 0 ? space.cursor : space.start;
        auto next = m.by_view.lower_bound(at);
        if (next != m.by_view.begin()) {
            auto before = std::prev(next);
            std::uintptr_t after = round_up(before->first + before->second.size + VIEW_ALIGN,
                                            VIEW_ALIGN);
            if (after > at)
                at = after;
        }
        while (at + needed <= space.end) {
            if (next == m.by_view.end() || next->first >= space.end || at + needed <= next->first)
                return at;
            at = round_up(next->first + next->second.size + VIEW_ALIGN, VIEW_ALIGN);
            ++next;
        }
    }
    return 0;
}

/* The allocation holding ptr, or null: one of a device's, by its view. */
const Allocation *find_view(Memory &m, std::uintptr_t ptr)
{
    auto it = m.by_view.upper_bound(ptr);
    if (it == m.by_view.begin())
        return nullptr;
    --it;
    const Allocation &a = it->second;
    return ptr <= a.view + a.size ? &a : nullptr;
}

const Allocation *find_alias(Memory &m, std::uintptr_t ptr)
{
    auto it = m.view_by_alias.upper_bound(ptr);
    if (it == m.view_by_alias.begin())
        return nullptr;
    --it;
    const Allocation &a = m.by_view.at(it->second);
    return ptr < (std::uintptr_t)a.alias + a.size ? &a : nullptr;
}

bool in_reservation(Memory &m, std::uintptr_t ptr, int *device)
{
    for (std::size_t d = 0; d < m.devices.size(); d++) {
        if (ptr >= m.devices[d].start && ptr < m.devices[d].end) {
            *device = (int)d;
            return true;
        }
    }
    return false;
}

Where locate_locked(Memory &m, const void *ptr, std::size_t nbytes, void **usable, int *device,
                    const Allocation **allocation)
{
    std::uintptr_t p = (std::uintptr_t)ptr;
    *usable = const_cast<void *>(ptr);
    *device = -1;
    if (allocation)
        *allocation = nullptr;
    if (in_reservation(m, p, device)) {
        const Allocation *a = find_view(m, p);
        if (!a || p + nbytes > a->view + a->size || p + nbytes < p)
            return Where::freed;
        *usable = a->alias + (p - a->view);
        *device = a->device;
        if (allocation)
            *allocation = a;
        return Where::device;
    }
    if (const Allocation *a = find_alias(m, p)) {
        *device = a->device;
        if (allocation)
            *allocation = a;
        return Where::alias;
    }
    auto it = m.pinned.upper_bound(p);
    if (it != m.pinned.begin()) {
        --it;
        if (p < it->first + it->second.size && p + nbytes <= it->first + it->second.size)
            return Where::pinned;
    }
    return Where::host;
}

bool overlaps_pinned(Memory &m, std::uintptr_t p, std::size_t n)
{
    auto it = m.pinned.lower_bound(p);
    if (it != m.pinned.end() && it->first < p + n)
        return true;
    if (it != m.pinned.begin()) {
        --it;
        if (it->first + it->second.size > p)
            return true;
    }
    return false;
}

} /* namespace */

Where locate(const void *ptr, std::size_t nbytes, void **usable, int *device)
{
    Memory &m = memory();
    std::lock_guard<std::mutex> lock(m.mutex);
    return locate_locked(m, ptr, nbytes, usable, device, nullptr);
}

} /* namespace cudasim */

using namespace cudasim;

/* ---- device memory ---------------------------------------------------------------------- */

extern "C" cudaError_t cudaMalloc(void **ptr, size_t size)
{
    cudaError_t err = enter("cudaMalloc");
    if (err != cudaSuccess)
        return err;
    if (!ptr)
        return fail(cudaErrorInvalidValue);
    *ptr = nullptr;
    if (size == 0)
        return cudaSuccess;
    int device = current_device();
    if ((err = check_device(device)) != cudaSuccess)
        return fail(err);
    Memory &m = memory();
    std::size_t charged = round_up(size, CHARGE_UNIT);
    if (charged < size)
        return fail(cudaErrorMemoryAllocation);
    std::size_t data = round_up(size, 256);
    std::size_t mapping_bytes = round_up(data, page_size()) + page_size();
    {
        std::lock_guard<std::mutex> lock(m.mutex);
        DeviceSpace &space = m.devices[(std::size_t)device];
        if (space.start == 0 || charged > config().device_bytes - space.used)
            return fail(cudaErrorMemoryAllocation);
        space.used += charged;      /* held while mapping, given back on failure */
    }
    /* The alias: data against the guard page that ends the mapping. */
    char *mapping = (char *)mmap(nullptr, mapping_bytes, PROT_NONE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    int fd = mapping == MAP_FAILED ? -1 : memfd_create("cudasim-device", MFD_CLOEXEC);
    bool mapped = false;
    if (fd >= 0 && ftruncate(fd, (off_t)(mapping_bytes - page_size())) == 0)
        mapped = mmap(mapping, mapping_bytes - page_size(), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_FIXED, fd, 0) != MAP_FAILED;
    if (fd >= 0)
        close(fd);
    char *alias = mapping + (mapping_bytes - page_size() - data);
    if (mapped)
        std::memset(alias, 0xFF, size);
    std::lock_guard<std::mutex> lock(m.mutex);
    DeviceSpace &space = m.devices[(std::size_t)device];
    std::uintptr_t view = mapped ? place(m, space, size) : 0;
    if (!view) {
        if (mapping != MAP_FAILED)
            munmap(mapping, mapping_bytes);
        space.used -= charged;
        return fail(cudaErrorMemoryAllocation);
    }
    space.cursor = view + round_up(size, VIEW_ALIGN) + VIEW_ALIGN;
    m.by_view[view] = Allocation{view, size, alias, mapping, mapping_bytes, charged, device};
    m.view_by_alias[(std::uintptr_t)alias] = view;
    *ptr = (void *)view;
    return cudaSuccess;
}

/* Frees after the device's queued work, as the runtime's cudaFree does
 * (it synchronizes the device). */
extern "C" cudaError_t cudaFree(void *ptr)
{
    cudaError_t err = enter("cudaFree");
    if (err != cudaSuccess)
        return err;
    if (!ptr)
        return cudaSuccess;
    Memory &m = memory();
    int device = -1;
    {
        std::lock_guard<std::mutex> lock(m.mutex);
        auto it = m.by_view.find((std::uintptr_t)ptr);
        if (it == m.by_view.end()) {
            std::fprintf(stderr, "cudasim: cudaFree(%p): not a live allocation's start\n", ptr);
            return fail(cudaErrorInvalidValue);
        }
        device = it->second.device;
    }
    synchronize_device(device);
    std::lock_guard<std::mutex> lock(m.mutex);
    auto it = m.by_view.find((std::uintptr_t)ptr);
    if (it == m.by_view.end())
        return fail(cudaErrorInvalidValue);     /* freed twice, concurrently */
    Allocation a = it->second;
    m.by_view.erase(it);
    m.view_by_alias.erase((std::uintptr_t)a.alias);
    m.devices[(std::size_t)a.device].used -= a.charged;
    munmap(a.mapping, a.mapping_bytes);
    return cudaSuccess;
}

extern "C" cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    cudaError_t err = enter("cudaMemGetInfo");
    if (err != cudaSuccess)
        return err;
    if (!free_bytes || !total_bytes)
        return fail(cudaErrorInvalidValue);
    int device = current_device();
    if ((err = check_device(device)) != cudaSuccess)
        return fail(err);
    Memory &m = memory();
    std::lock_guard<std::mutex> lock(m.mutex);
    *total_bytes = config().device_bytes;
    *free_bytes = config().device_bytes - m.devices[(std::size_t)device].used;
    return cudaSuccess;
}

/* ---- page-locked host memory ---------------------------------------------------------------- */

namespace {

cudaError_t reserve_pinned(Memory &m, std::size_t bytes)
{
    std::size_t limit = config().pinned_limit;
    if (limit && (bytes > limit || m.pinned_bytes > limit - bytes))
        return cudaErrorMemoryAllocation;
    m.pinned_bytes += bytes;
    return cudaSuccess;
}

} /* namespace */

extern "C" cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags)
{
    cudaError_t err = enter("cudaHostAlloc");
    if (err != cudaSuccess)
        return err;
    if (!ptr || (flags & ~0x7u))
        return fail(cudaErrorInvalidValue);
    *ptr = nullptr;
    if (size == 0)
        return cudaSuccess;
    Memory &m = memory();
    {
        std::lock_guard<std::mutex> lock(m.mutex);
        if ((err = reserve_pinned(m, size)) != cudaSuccess)
            return fail(err);
    }
    void *memory_block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                              -1, 0);
    std::lock_guard<std::mutex> lock(m.mutex);
    if (memory_block == MAP_FAILED) {
        m.pinned_bytes -= size;
        return fail(cudaErrorMemoryAllocation);
    }
    m.pinned[(std::uintptr_t)memory_block] = PinnedRange{size, false};
    *ptr = memory_block;
    return cudaSuccess;
}

extern "C" cudaError_t cudaMallocHost(void **ptr, size_t size)
{
    return cudaHostAlloc(ptr, size, cudaHostAllocDefault);
}

/* Waits for every device's queued work first, as the runtime's does. */
extern "C" cudaError_t cudaFreeHost(void *ptr)
{
    cudaError_t err = enter("cudaFreeHost");
    if (err != cudaSuccess)
        return err;
    if (!ptr)
        return cudaSuccess;
    Memory &m = memory();
    {
        std::lock_guard<std::mutex> lock(m.mutex);
        auto it = m.pinned.find((std::uintptr_t)ptr);
        if (it == m.pinned.end() || it->second.registered) {
            std::fprintf(stderr, "cudasim: cudaFreeHost(%p): not memory from cudaHostAlloc\n", ptr);
            return fail(cudaErrorInvalidValue);
        }
    }
    for (int d = 0; d < config().devices; d++)
        synchronize_device(d);
    std::lock_guard<std::mutex> lock(m.mutex);
    auto it = m.pinned.find((std::uintptr_t)ptr);
    if (it == m.pinned.end())
        return fail(cudaErrorInvalidValue);
    std::size_t size = it->second.size;
    m.pinned.erase(it);
    m.pinned_bytes -= size;
    munmap(ptr, size);
    return cudaSuccess;
}

extern "C" cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
    cudaError_t err = enter("cudaHostRegister");
    if (err != cudaSuccess)
        return err;
    if (!ptr || size == 0 || (flags & ~0xFu))
        return fail(cudaErrorInvalidValue);
    Memory &m = memory();
    std::lock_guard<std::mutex> lock(m.mutex);
    void *usable;
    int device;
    Where where = locate_locked(m, ptr, size, &usable, &device, nullptr);
    if (where == Where::device || where == Where::freed || where == Where::alias)
        return fail(cudaErrorInvalidValue);
    if (overlaps_pinned(m, (std::uintptr_t)ptr, size))
        return fail(cudaErrorHostMemoryAlreadyRegistered);
    if ((err = reserve_pinned(m, size)) != cudaSuccess)
        return fail(err);
    m.pinned[(std::uintptr_t)ptr] = PinnedRange{size, true};
    return cudaSuccess;
}

extern "C" cudaError_t cudaHostUnregister(void *ptr)
{
    cudaError_t err = enter("cudaHostUnregister");
    if (err != cudaSuccess)
        return err;
    Memory &m = memory();
    std::lock_guard<std::mutex> lock(m.mutex);
    auto it = m.pinned.find((std::uintptr_t)ptr);
    if (!ptr || it == m.pinned.end() || !it->second.registered)
        return fail(cudaErrorHostMemoryNotRegistered);
    m.pinned_bytes -= it->second.size;
    m.pinned.erase(it);
    return cudaSuccess;
}

extern "C" cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes,
                                                const void *ptr)
{
    cudaError_t err = enter("cudaPointerGetAttributes");
    if (err != cudaSuccess)
        return err;
    if (!attributes)
        return fail(cudaErrorInvalidValue);
    void *usable;
    int device;
    Where where = locate(ptr, 0, &usable, &device);
    *attributes = cudaPointerAttributes{cudaMemoryTypeUnregistered, -2, nullptr, nullptr};
    switch (where) {
    case Where::device:
        *attributes = cudaPointerAttributes{cudaMemoryTypeDevice, device, const_cast<void *>(ptr),
                                            nullptr};
        return cudaSuccess;
    case Where::pinned:
        *attributes = cudaPointerAttributes{cudaMemoryTypeHost, current_device(),
                                            const_cast<void *>(ptr), const_cast<void *>(ptr)};
        return cudaSuccess;
    case Where::freed:
        return fail(cudaErrorInvalidValue);
    default:
        return cudaSuccess;
    }
}

/* ---- what the simulator adds ------------------------------------------------------------------ */

extern "C" cudaError_t cudasim_host_alias(const void *device_ptr, size_t nbytes, void **alias,
                                          int *device)
{
    if (!alias || !device)
        return cudaErrorInvalidValue;
    return locate(device_ptr, nbytes, alias, device) == Where::device ? cudaSuccess
                                                                       : cudaErrorInvalidDevicePointer;
}

extern "C" cudaError_t cudasim_device_pointer(const void *alias, size_t nbytes, void **device_ptr,
                                              int *device)
{
    if (!device_ptr || !device)
        return cudaErrorInvalidValue;
    Memory &m = memory();
    std::lock_guard<std::mutex> lock(m.mutex);
    void *usable;
    const Allocation *a = nullptr;
    if (locate_locked(m, alias, nbytes, &usable, device, &a) != Where::alias || !a)
        return cudaErrorInvalidValue;
    std::uintptr_t offset = (std::uintptr_t)alias - (std::uintptr_t)a->alias;
    if (offset + nbytes > a->size)
        return cudaErrorInvalidValue;
    *device_ptr = (void *)(a->view + offset);
    return cudaSuccess;
}

extern "C" cudaError_t cudasim_kernel_pointer(const void *ptr, void **usable, const char *name)
{
    *usable = const_cast<void *>(ptr);
    if (!ptr)
        return cudaSuccess;
    int device;
    Where where = locate(ptr, 0, usable, &device);
    if (where == Where::pinned)
        return cudaSuccess;
    if (where == Where::device && device == current_device())
        return cudaSuccess;
    const char *what = where == Where::device ? "memory of another device"
                       : where == Where::freed ? "a freed or out-of-range device address"
                       : where == Where::alias ? "the host alias of device memory"
                                               : "host memory that is not page-locked";
    char why[256];
    std::snprintf(why, sizeof why, "launch of %s: pointer argument %p is %s",
                  name ? name : "a kernel", ptr, what);
    set_sticky(current_device(), cudaErrorIllegalAddress, why);
    *usable = const_cast<void *>(ptr);
    return cudaErrorIllegalAddress;
}

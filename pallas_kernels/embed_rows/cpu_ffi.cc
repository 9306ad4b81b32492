// XLA FFI binding of the CPU row gather: ikjax_cpu_embed_rows.
//   operands:   table u8 [V, R] (GGUF blocks of the token embedding, R bytes a row);
//               tokens s32 [...] (ids; as `table[tokens]` in jnp: negative from the end, then clamped)
//   result:     out u8 [..., R] = table[tokens]
//
// Why not XLA's gather: the table is the memory map of the GGUF file, and touching one row through
// the mapping makes the kernel map the 64 KiB of cached file pages around it too ("fault-around",
// not turned off by MADV_RANDOM). A 512-token prompt of random ids then puts 30-100 MiB of an
// embedding table into the process's RSS for a few KiB of rows (bench/RESULTS.md §9e). Here each
// row is read with pread() from the file the table is mapped from: the bytes come from the page
// cache (the same bytes the mapping shows), nothing is mapped, RSS does not grow.
//
// The file and offset of a row are looked up per call from the kernel (PROCMAP_QUERY on
// /proc/self/maps, Linux >= 6.11: one ioctl per mapping touched), so a table unmapped and its
// address reused is never read from a stale file; an open descriptor is kept per (device, inode)
// and checked against the mapping's. Where that lookup is unavailable (another OS, an older
// kernel, an anonymous copy of the table, a file replaced on disk) the row is copied through the
// mapping as XLA would: the same bytes, only the RSS saving is lost.
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#endif

#include "cpu/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__linux__)
// linux/fs.h of 6.11 (defined here: build hosts may have older headers)
struct ProcmapQuery {
  uint64_t size, query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size, vma_offset, inode;
  uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
  uint64_t vma_name_addr, build_id_addr;
};
constexpr unsigned long kProcmapQuery = _IOWR('f', 17, ProcmapQuery);

// An open descriptor, closed when its last holder lets go: `forget` takes a file out of the cache while
// a call may still be reading it, and the number must not be reused under that call.
struct OpenFile {
  int fd;
  explicit OpenFile(int f) : fd(f) {}
  ~OpenFile() { close(fd); }
};

// One file-backed mapping: [start, end) shows file `file->fd` from byte `offset`.
struct Vma {
  uintptr_t start = 0, end = 0;
  uint64_t offset = 0;
  // null: not a file we can pread (anonymous, deleted, replaced, private and writable): copy
  // through the mapping
  std::shared_ptr<OpenFile> file;
};

class Files {
 public:
  // The mapping around `addr`, its file opened (kept open for later calls).
  Vma lookup(uintptr_t addr) {
    std::lock_guard<std::mutex> lock(mu_);
    Vma v;
    if (maps_fd_ == -2) return v;  // PROCMAP_QUERY unavailable here
    if (maps_fd_ < 0) maps_fd_ = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (maps_fd_ < 0) {
      maps_fd_ = -2;
      return v;
    }
    char name[4096];
    ProcmapQuery q{};
    q.size = sizeof(q);
    q.query_addr = addr;
    q.vma_name_addr = reinterpret_cast<uint64_t>(name);
    q.vma_name_size = sizeof(name);
    if (ioctl(maps_fd_, kProcmapQuery, &q) != 0) {
      if (errno == ENOTTY || errno == EINVAL) maps_fd_ = -2;  // an older kernel: never ask again
      return v;
    }
    v.start = q.vma_start, v.end = q.vma_end, v.offset = q.vma_offset;
    if (q.inode == 0 || q.vma_name_size == 0 || name[0] != '/') return v;  // anonymous or special
    // a private mapping that may be written (copy-on-write): its pages may hold other bytes than
    // the file's, so they are copied through the mapping (PROCMAP_QUERY_VMA_WRITABLE / _SHARED)
    constexpr uint64_t kWritable = 2, kShared = 8;
    if ((q.vma_flags & kWritable) && !(q.vma_flags & kShared)) return v;
    const uint64_t dev = makedev(q.dev_major, q.dev_minor);
    const std::string key = Key(dev, q.inode);
    auto it = fds_.find(key);
    if (it == fds_.end()) {
      int fd = open(name, O_RDONLY | O_CLOEXEC);
      struct stat st;
      if (fd >= 0 && (fstat(fd, &st) != 0 || st.st_ino != q.inode || st.st_dev != dev)) {
        close(fd);  // the path now names another file: this mapping's bytes are not there
        fd = -1;
      }
      if (fd < 0) return v;
      it = fds_.emplace(key, std::make_shared<OpenFile>(fd)).first;
    }
    v.file = it->second;
    return v;
  }

  // Let go of the descriptor of file (dev, inode), if one is open (an engine closed: its file's
  // space is freed once deleted; a later call on a mapping of it opens it again).
  bool forget(uint64_t dev, uint64_t inode) {
    std::lock_guard<std::mutex> lock(mu_);
    return fds_.erase(Key(dev, inode)) > 0;
  }

 private:
  static std::string Key(uint64_t dev, uint64_t inode) { return std::to_string(dev) + ":" + std::to_string(inode); }
  std::mutex mu_;
  int maps_fd_ = -1;
  std::unordered_map<std::string, std::shared_ptr<OpenFile>> fds_;
};

Files& files() {
  static Files f;
  return f;
}

// 1: read; 0: an error (read through the mapping instead); -1: the file ends before these bytes (it
// was truncated under its mapping, whose pages past the new end would kill the process with SIGBUS)
int pread_all(int fd, uint8_t* dst, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t r = pread(fd, dst, n, static_cast<off_t>(off));
    if (r == 0) return -1;
    if (r < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    dst += r, n -= static_cast<size_t>(r), off += static_cast<uint64_t>(r);
  }
  return 1;
}
#endif

}  // namespace

namespace ikj {
bool embed_rows_forget_file(uint64_t dev, uint64_t inode) {
#if defined(__linux__)
  return files().forget(dev, inode);
#else
  (void)dev, (void)inode;
  return false;
#endif
}
}  // namespace ikj

static ffi::Error EmbedRowsImpl(ffi::Buffer<ffi::U8> table, ffi::Buffer<ffi::S32> tokens,
                                ffi::ResultBuffer<ffi::U8> out) {
  auto td = table.dimensions();
  if (td.size() != 2) return ffi::Error::InvalidArgument("embed_rows: table must be [V, R] bytes");
  const int64_t V = td[0], R = td[1], n = static_cast<int64_t>(tokens.element_count());
  if (V == 0 && n > 0) return ffi::Error::InvalidArgument("embed_rows: the table has no rows");
  if (static_cast<int64_t>(out->element_count()) != n * R)
    return ffi::Error::InvalidArgument("embed_rows: out must be [..., R] for tokens [...]");
  const uint8_t* base = table.typed_data();
  const int32_t* ids = tokens.typed_data();
  uint8_t* dst = out->typed_data();
#if defined(__linux__)
  Vma v;  // the mapping of the last row read
#endif
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = ids[i] < 0 ? ids[i] + V : ids[i];  // as jnp indexing: negative ids from the end, then clamped
    t = t < 0 ? 0 : (t >= V ? V - 1 : t);
    const uint8_t* row = base + t * R;
    uint8_t* o = dst + i * R;
#if defined(__linux__)
    const uintptr_t a = reinterpret_cast<uintptr_t>(row);
    if (a < v.start || a + static_cast<uintptr_t>(R) > v.end) v = files().lookup(a);
    if (v.file && a >= v.start && a + static_cast<uintptr_t>(R) <= v.end) {
      const int got = pread_all(v.file->fd, o, static_cast<size_t>(R), v.offset + (a - v.start));
      if (got > 0) continue;
      if (got < 0)
        return ffi::Error::Internal("embed_rows: the model file is shorter than when it was loaded (truncated on "
                                    "disk); load it again");
    }
#endif
    std::memcpy(o, row, static_cast<size_t>(R));
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedRowsFfi, EmbedRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>());

static ikj::FfiRegistration reg("ikjax_cpu_embed_rows", reinterpret_cast<void*>(EmbedRowsFfi));

// Lazy loading of libcudart and libnccl (see nccl_loader.h).
#include "src/nccl/nccl_loader.h"

#include <dlfcn.h>

#include <initializer_list>
#include <string>

#include "collectives/errors.h"

namespace collectives::nccl {
namespace {

struct Loaded {
  NcclApi api;
  bool cudart_ok = false;
  bool ok = false;             // libnccl too
  std::string cudart_reason;   // when !cudart_ok: "CUDA is not available: ..."
  std::string reason;          // when !ok: "NCCL is not available: ..."
};

// dlopens the first of `names` that loads; null with *error listing every dlerror otherwise.
void* OpenFirst(std::initializer_list<const char*> names, std::string* error) {
  for (const char* name : names) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return handle;
    const char* text = dlerror();
    if (!error->empty()) *error += "; ";
    *error += text != nullptr ? text : std::string("cannot load ") + name;
  }
  return nullptr;
}

template <typename Fn>
bool Resolve(void* handle, const char* library, const char* name, Fn* out, std::string* error) {
  dlerror();
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) {
    const char* text = dlerror();
    *error = std::string(library) + " lacks " + name +
             (text != nullptr ? std::string(": ") + text : std::string());
    return false;
  }
  *out = reinterpret_cast<Fn>(symbol);
  return true;
}

// libcudart first (with a visible device), then libnccl: a failure of the first is the reason
// for both.
Loaded Load() {
  Loaded loaded;
  NcclApi& api = loaded.api;
  std::string error;
  auto fail_cudart = [&](const std::string& why) {
    loaded.cudart_reason = "CUDA is not available: " + why;
    loaded.reason = "NCCL is not available: " + why;
    api = NcclApi{};
    return loaded;
  };

  void* cudart = OpenFirst({"libcudart.so.13", "libcudart.so.12", "libcudart.so"}, &error);
  if (cudart == nullptr) return fail_cudart(error);
#define COLLECTIVES_NCCL_RESOLVE_CUDART(name) \
  if (!Resolve(cudart, "libcudart", #name, &api.name, &error)) return fail_cudart(error);
  COLLECTIVES_CUDART_FUNCTIONS(COLLECTIVES_NCCL_RESOLVE_CUDART)
  COLLECTIVES_NCCL_RESOLVE_CUDART(cudaMalloc)
  COLLECTIVES_NCCL_RESOLVE_CUDART(cudaHostAlloc)
#undef COLLECTIVES_NCCL_RESOLVE_CUDART
  const cudaError_t status = api.cudaGetDeviceCount(&api.device_count);
  if (status != cudaSuccess) {
    return fail_cudart(std::string("cudaGetDeviceCount: ") + api.cudaGetErrorString(status));
  }
  if (api.device_count <= 0) return fail_cudart("no CUDA device is visible");
  loaded.cudart_ok = true;

  NcclApi with_nccl = api;
  auto fail = [&](const std::string& why) {
    loaded.reason = "NCCL is not available: " + why;
    return loaded;
  };
  error.clear();  // libcudart loaded: its earlier names' failures are not the reason
  void* libnccl = OpenFirst({"libnccl.so.2", "libnccl.so"}, &error);
  if (libnccl == nullptr) return fail(error);
#define COLLECTIVES_NCCL_RESOLVE_NCCL(name) \
  if (!Resolve(libnccl, "libnccl", #name, &with_nccl.name, &error)) return fail(error);
  COLLECTIVES_NCCL_FUNCTIONS(COLLECTIVES_NCCL_RESOLVE_NCCL)
#undef COLLECTIVES_NCCL_RESOLVE_NCCL

  if (with_nccl.ncclGetVersion(&with_nccl.nccl_version) != ncclSuccess) {
    return fail("ncclGetVersion failed");
  }
  if (with_nccl.nccl_version < kMinNcclVersion) {
    return fail("NCCL " + std::to_string(with_nccl.nccl_version) + " is older than " +
                std::to_string(kMinNcclVersion) + " (non-blocking communicators)");
  }
  api = with_nccl;
  loaded.ok = true;
  return loaded;
}

const Loaded& Get() {
  static const Loaded loaded = Load();  // thread-safe, once
  return loaded;
}

}  // namespace

const NcclApi* TryLoadNccl(std::string* reason) {
  const Loaded& loaded = Get();
  if (loaded.ok) return &loaded.api;
  if (reason != nullptr) *reason = loaded.reason;
  return nullptr;
}

const NcclApi* TryLoadCudart(std::string* reason) {
  const Loaded& loaded = Get();
  if (loaded.cudart_ok) return &loaded.api;
  if (reason != nullptr) *reason = loaded.cudart_reason;
  return nullptr;
}

const NcclApi& LoadCudart() {
  const Loaded& loaded = Get();
  if (!loaded.cudart_ok) throw Error(ErrorCode::kNotSupported, loaded.cudart_reason);
  return loaded.api;
}

const NcclApi& LoadNccl() {
  const Loaded& loaded = Get();
  if (!loaded.ok) throw Error(ErrorCode::kNotSupported, loaded.reason);
  return loaded.api;
}

}  // namespace collectives::nccl

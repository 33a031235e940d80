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
  bool ok = false;
  std::string reason;  // when !ok: "NCCL is not available: ..."
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

Loaded Load() {
  Loaded loaded;
  NcclApi& api = loaded.api;
  std::string error;
  auto fail = [&](const std::string& why) {
    loaded.reason = "NCCL is not available: " + why;
    return loaded;
  };

  void* cudart = OpenFirst({"libcudart.so.13", "libcudart.so.12", "libcudart.so"}, &error);
  if (cudart == nullptr) return fail(error);
#define COLLECTIVES_NCCL_RESOLVE_CUDART(name) \
  if (!Resolve(cudart, "libcudart", #name, &api.name, &error)) return fail(error);
  COLLECTIVES_CUDART_FUNCTIONS(COLLECTIVES_NCCL_RESOLVE_CUDART)
  COLLECTIVES_NCCL_RESOLVE_CUDART(cudaMalloc)
#undef COLLECTIVES_NCCL_RESOLVE_CUDART

  error.clear();  // libcudart loaded: its earlier names' failures are not the reason
  void* libnccl = OpenFirst({"libnccl.so.2", "libnccl.so"}, &error);
  if (libnccl == nullptr) return fail(error);
#define COLLECTIVES_NCCL_RESOLVE_NCCL(name) \
  if (!Resolve(libnccl, "libnccl", #name, &api.name, &error)) return fail(error);
  COLLECTIVES_NCCL_FUNCTIONS(COLLECTIVES_NCCL_RESOLVE_NCCL)
#undef COLLECTIVES_NCCL_RESOLVE_NCCL

  if (api.ncclGetVersion(&api.nccl_version) != ncclSuccess) {
    return fail("ncclGetVersion failed");
  }
  if (api.nccl_version < kMinNcclVersion) {
    return fail("NCCL " + std::to_string(api.nccl_version) + " is older than " +
                std::to_string(kMinNcclVersion) + " (non-blocking communicators)");
  }
  const cudaError_t status = api.cudaGetDeviceCount(&api.device_count);
  if (status != cudaSuccess) {
    return fail(std::string("cudaGetDeviceCount: ") + api.cudaGetErrorString(status));
  }
  if (api.device_count <= 0) return fail("no CUDA device is visible");
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

const NcclApi& LoadNccl() {
  const Loaded& loaded = Get();
  if (!loaded.ok) throw Error(ErrorCode::kNotSupported, loaded.reason);
  return loaded.api;
}

}  // namespace collectives::nccl

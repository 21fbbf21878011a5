/* A pass-through Vulkan ICD in front of Mesa's lavapipe, built by attnreg/vkshim.py.
 *
 * Why: Dawn (wgpudawn, onnxruntime-webgpu, Chromium) refuses a Vulkan device that lacks
 * shaderSampledImageArrayDynamicIndexing and shaderStorageImageArrayDynamicIndexing;
 * Debian 12's Mesa 22.3 lavapipe reports both as absent. Compute shaders over storage
 * buffers never declare those capabilities, so this ICD reports the two features as present
 * and forwards every call to lavapipe unchanged. The features are taken out again when a
 * device is created, so lavapipe is never asked to enable what it lacks.
 *
 * The loader finds us through an ICD manifest whose library_path is this library; the real
 * driver is dlopen'ed from ATTNREG_REAL_ICD (a build-time define, overridable at run time by
 * the environment variable of the same name).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vulkan/vulkan.h>

#ifndef ATTNREG_REAL_ICD
#define ATTNREG_REAL_ICD "libvulkan_lvp.so"
#endif

#define EXPORT __attribute__((visibility("default")))

typedef PFN_vkVoidFunction (VKAPI_PTR *PFN_icdGetProcAddr)(VkInstance, const char *);
typedef VkResult (VKAPI_PTR *PFN_icdNegotiate)(uint32_t *);

static void *real_lib;
static PFN_icdGetProcAddr real_gipa;       /* vk_icdGetInstanceProcAddr of the driver */
static PFN_icdGetProcAddr real_gpdpa;      /* vk_icdGetPhysicalDeviceProcAddr, may be NULL */
static PFN_icdNegotiate real_negotiate;

/* The driver's own entry points we wrap, looked up once (lavapipe's are process-wide). */
static PFN_vkGetPhysicalDeviceFeatures real_features;
static PFN_vkGetPhysicalDeviceFeatures2 real_features2;
static PFN_vkGetPhysicalDeviceFeatures2 real_features2_khr;
static PFN_vkCreateDevice real_create_device;

static int load_real(void) {
    if (real_lib) return 1;
    const char *path = getenv("ATTNREG_REAL_ICD");
    if (!path || !*path) path = ATTNREG_REAL_ICD;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "attnreg vkshim: cannot load %s: %s\n", path, dlerror());
        return 0;
    }
    real_gipa = (PFN_icdGetProcAddr)dlsym(lib, "vk_icdGetInstanceProcAddr");
    real_gpdpa = (PFN_icdGetProcAddr)dlsym(lib, "vk_icdGetPhysicalDeviceProcAddr");
    real_negotiate = (PFN_icdNegotiate)dlsym(lib, "vk_icdNegotiateLoaderICDInterfaceVersion");
    if (!real_gipa) {
        fprintf(stderr, "attnreg vkshim: %s is not a Vulkan ICD\n", path);
        dlclose(lib);
        return 0;
    }
    real_lib = lib;
    return 1;
}

static void add_image_array_indexing(VkPhysicalDeviceFeatures *f) {
    f->shaderSampledImageArrayDynamicIndexing = VK_TRUE;
    f->shaderStorageImageArrayDynamicIndexing = VK_TRUE;
}

static void VKAPI_CALL shim_features(VkPhysicalDevice pd, VkPhysicalDeviceFeatures *f) {
    real_features(pd, f);
    add_image_array_indexing(f);
}

static void VKAPI_CALL shim_features2(VkPhysicalDevice pd, VkPhysicalDeviceFeatures2 *f) {
    real_features2(pd, f);
    add_image_array_indexing(&f->features);
}

static void VKAPI_CALL shim_features2_khr(VkPhysicalDevice pd, VkPhysicalDeviceFeatures2 *f) {
    real_features2_khr(pd, f);
    add_image_array_indexing(&f->features);
}

/* Clear, in `want`, the two features the driver really lacks. */
static void drop_absent(VkPhysicalDevice pd, VkPhysicalDeviceFeatures *want) {
    VkPhysicalDeviceFeatures have;
    memset(&have, 0, sizeof have);
    real_features(pd, &have);
    if (!have.shaderSampledImageArrayDynamicIndexing)
        want->shaderSampledImageArrayDynamicIndexing = VK_FALSE;
    if (!have.shaderStorageImageArrayDynamicIndexing)
        want->shaderStorageImageArrayDynamicIndexing = VK_FALSE;
}

static VkResult VKAPI_CALL shim_create_device(VkPhysicalDevice pd, const VkDeviceCreateInfo *ci,
                                              const VkAllocationCallbacks *alloc, VkDevice *out) {
    VkDeviceCreateInfo copy = *ci;
    VkPhysicalDeviceFeatures plain;
    if (ci->pEnabledFeatures) {
        plain = *ci->pEnabledFeatures;
        drop_absent(pd, &plain);
        copy.pEnabledFeatures = &plain;
    }
    /* A VkPhysicalDeviceFeatures2 in the chain is the caller's memory: edit it for the call
     * and put it back, rather than copying a chain of structs of unknown sizes. */
    VkPhysicalDeviceFeatures2 *f2 = NULL;
    for (VkBaseOutStructure *s = (VkBaseOutStructure *)ci->pNext; s; s = s->pNext)
        if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2) {
            f2 = (VkPhysicalDeviceFeatures2 *)s;
            break;
        }
    VkPhysicalDeviceFeatures saved;
    if (f2) {
        saved = f2->features;
        drop_absent(pd, &f2->features);
    }
    VkResult r = real_create_device(pd, &copy, alloc, out);
    if (f2) f2->features = saved;
    return r;
}

/* Our wrapper for `name` if we wrap it (remembering the driver's entry point), else NULL. */
static PFN_vkVoidFunction wrap(PFN_icdGetProcAddr get, VkInstance inst, const char *name) {
    struct { const char *name; void **real; PFN_vkVoidFunction ours; } table[] = {
        {"vkGetPhysicalDeviceFeatures", (void **)&real_features, (PFN_vkVoidFunction)shim_features},
        {"vkGetPhysicalDeviceFeatures2", (void **)&real_features2, (PFN_vkVoidFunction)shim_features2},
        {"vkGetPhysicalDeviceFeatures2KHR", (void **)&real_features2_khr,
         (PFN_vkVoidFunction)shim_features2_khr},
        {"vkCreateDevice", (void **)&real_create_device, (PFN_vkVoidFunction)shim_create_device},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(name, table[i].name) != 0) continue;
        PFN_vkVoidFunction got = get(inst, name);
        if (!got) return NULL;
        *table[i].real = (void *)got;
        /* The plain features query backs the device-creation check: make sure we have it. */
        if (!real_features)
            real_features = (PFN_vkGetPhysicalDeviceFeatures)get(inst, "vkGetPhysicalDeviceFeatures");
        return real_features ? table[i].ours : got;
    }
    return NULL;
}

EXPORT VkResult VKAPI_CALL vk_icdNegotiateLoaderICDInterfaceVersion(uint32_t *version) {
    if (!load_real()) return VK_ERROR_INCOMPATIBLE_DRIVER;
    if (real_negotiate) return real_negotiate(version);
    if (*version > 1) *version = 1;   /* a driver without the call speaks version 0/1 */
    return VK_SUCCESS;
}

EXPORT PFN_vkVoidFunction VKAPI_CALL vk_icdGetInstanceProcAddr(VkInstance inst, const char *name) {
    if (!load_real()) return NULL;
    PFN_vkVoidFunction ours = wrap(real_gipa, inst, name);
    return ours ? ours : real_gipa(inst, name);
}

EXPORT PFN_vkVoidFunction VKAPI_CALL vk_icdGetPhysicalDeviceProcAddr(VkInstance inst, const char *name) {
    if (!load_real()) return NULL;
    PFN_icdGetProcAddr get = real_gpdpa ? real_gpdpa : real_gipa;
    PFN_vkVoidFunction ours = wrap(get, inst, name);
    return ours ? ours : get(inst, name);
}

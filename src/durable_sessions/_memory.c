/*
 * durable_sessions._memory: folding a checked action into its session's packed memory.
 *
 * SessionState.remember (durable_sessions/rules/state.py) is the reference: it runs for
 * every record the engine accepts, and in CPython its bytecode was some 40% of a big
 * offline check. Fold.remember does the same work in C, with the same results, and
 * leaves to the Python code what is rare or unusual:
 *
 * - the whole fold, when the record is not a plain dict, or the location or the prior
 *   memory is not the tuple it should be (nothing has been changed at that point);
 * - SessionState._remember_key_and_attempts, for records with attempts, a key or a
 *   prompt digest (it owns the keys and prompts maps), and every record of an action
 *   with numbered attempts;
 * - SessionState._pack, when the position is not a plain line number or a span id of
 *   up to 16 hex digits, or the outcome is not a 64-bit fingerprint;
 * - Symbols.prefix, the first time a kind, status or file is met, and
 *   SessionState.incarnation_index, the first time a session's incarnation changes;
 * - digest.fingerprint, for a result orjson cannot serialise.
 *
 * The packed layout (flag bits and shifts) is passed in by state.py, which defines it,
 * so the two cannot drift apart. tests/test_memory_native.py compares the two folds
 * over generated sessions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* -- SHA-256 (FIPS 180-4): an outcome's fingerprint is the first 64 bits of its digest -- */

static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void
sha256_block(uint32_t h[8], const unsigned char *block)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)block[4 * i] << 24 | (uint32_t)block[4 * i + 1] << 16
             | (uint32_t)block[4 * i + 2] << 8 | (uint32_t)block[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + SHA_K[i] + w[i];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += k;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHA_NI_PATH 1

/* The same compression with the CPU's SHA extensions, four rounds per step. */
__attribute__((target("sha,sse4.1,ssse3"))) static void
sha256_block_ni(uint32_t h[8], const unsigned char *block)
{
    const __m128i byte_swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i cdab = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1);
    __m128i efgh = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8), cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    __m128i abef_start = abef, cdgh_start = cdgh, w[4];
    for (int i = 0; i < 16; i++) {
        if (i < 4) {
            w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(block + 16 * i)), byte_swap);
        } else {
            __m128i t = _mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]);
            t = _mm_add_epi32(t, _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
            w[i & 3] = _mm_sha256msg2_epu32(t, w[(i + 3) & 3]);
        }
        __m128i message = _mm_add_epi32(w[i & 3], _mm_loadu_si128((const __m128i *)&SHA_K[4 * i]));
        cdgh = _mm_sha256rnds2_epu32(cdgh, abef, message);
        abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(message, 0x0E));
    }
    abef = _mm_add_epi32(abef, abef_start);
    cdgh = _mm_add_epi32(cdgh, cdgh_start);
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B), dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(dchg, feba, 8));
}

static int
cpu_has_sha_ni(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3))
        return 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29));
}
#endif

typedef void (*Sha256Block)(uint32_t h[8], const unsigned char *block);
static Sha256Block sha256_fast_block = sha256_block;

/* The first 64 bits of SHA-256(data), big-endian, as int.from_bytes(digest[:8], "big"). */
static uint64_t
sha256_prefix(const unsigned char *data, size_t len, Sha256Block compress)
{
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    size_t whole = len - len % 64;
    for (size_t at = 0; at < whole; at += 64)
        compress(h, data + at);
    unsigned char tail[128] = {0};
    size_t rest = len - whole;
    memcpy(tail, data + whole, rest);
    tail[rest] = 0x80;
    size_t tail_len = rest + 9 <= 64 ? 64 : 128;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++)
        tail[tail_len - 1 - i] = (unsigned char)(bits >> (8 * i));
    compress(h, tail);
    if (tail_len == 128)
        compress(h, tail + 64);
    return (uint64_t)h[0] << 32 | h[1];
}

/* -- names looked up on every fold ------------------------------------------------------ */

static PyObject *S_ACTION_ID, *S_STATUS, *S_KIND, *S_INCARNATION, *S_RETRYABLE, *S_REPLAYED,
    *S_SIDE_EFFECTS, *S_RESULT, *S_REDACTED, *S_RESULT_REF, *S_RESULT_DIGEST, *S_ATTEMPTS,
    *S_IDEMPOTENCY_KEY, *S_PROMPT_DIGEST, *S_OPTION, *A_ACTIONS, *A_DETAILS, *A_SYMBOLS,
    *A_PREFIXES, *A_INCARNATION, *A_MAX_ACTIONS, *M_PREFIX, *M_INCARNATION_INDEX, *M_PACK,
    *M_KEY_AND_ATTEMPTS, *M_FORGET_OLDEST_ACTION, *DASH, *OPTION_KEYWORD;

/* -- the fold ------------------------------------------------------------------------- */

/* The Python objects a fold uses, set by state.py (which owns the layout they describe). */
#define FOLD_OBJECTS(X)                                                                  \
    X(memory_type)     /* ActionMemory */                                             \
    X(details_type)    /* ActionDetails */                                            \
    X(python_remember) /* SessionState.remember, the reference */                     \
    X(side_effecting)  /* kinds.SIDE_EFFECTING */                                     \
    X(redacted)        /* record.REDACTED */                                          \
    X(no_attempts)     /* the empty frozenset */                                      \
    X(dumps)           /* orjson.dumps */                                             \
    X(dumps_option)    /* the canonical JSON options */                               \
    X(fingerprint)     /* digest.fingerprint, for values orjson refuses */

#define DECLARE(name) PyObject *name;
typedef struct {
    PyObject_HEAD
    FOLD_OBJECTS(DECLARE)
    unsigned long retryable, recorded, effect_done, has_details, has_outcome;
    int incarnation_shift, outcome_shift, position_shift;
} Fold;
#undef DECLARE

enum { WORDS = 4 };

static void
or_shifted(uint64_t words[WORDS], uint64_t value, int shift)
{
    int index = shift / 64, offset = shift % 64;
    words[index] |= value << offset;
    if (offset && index + 1 < WORDS)
        words[index + 1] |= value >> (64 - offset);
}

/* A non-negative Python int of at most 128 bits into words[0..1]; -1 if it is not one. */
static int
or_int(uint64_t words[WORDS], PyObject *value)
{
    unsigned char bytes[16];
    if (!PyLong_CheckExact(value))
        return -1;
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t needed = PyLong_AsNativeBytes(value, bytes, 16,
                                             Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (needed < 0 || needed > 16) {
        PyErr_Clear();
        return -1;
    }
#else
    if (_PyLong_AsByteArray((PyLongObject *)value, bytes, 16, 1, 0) < 0) {
        PyErr_Clear();
        return -1;
    }
#endif
    for (int i = 0; i < 16; i++)
        words[i / 8] |= (uint64_t)bytes[i] << (8 * (i % 8));
    return 0;
}

static PyObject *
int_from_words(const uint64_t words[WORDS])
{
    unsigned char bytes[8 * WORDS];
    for (int i = 0; i < 8 * WORDS; i++)
        bytes[i] = (unsigned char)(words[i / 8] >> (8 * (i % 8)));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(bytes, sizeof bytes, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray(bytes, sizeof bytes, 1, 0);
#endif
}

static int
hex_digit(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* A string of 1 to 16 ASCII hex digits and nothing else into *out; -1 otherwise. */
static int
parse_hex(PyObject *text, uint64_t *out, int lowercase_only)
{
    if (!PyUnicode_CheckExact(text) || !PyUnicode_IS_ASCII(text))
        return -1;
    Py_ssize_t len = PyUnicode_GET_LENGTH(text);
    if (len < 1 || len > 16)
        return -1;
    const unsigned char *p = PyUnicode_1BYTE_DATA(text);
    uint64_t value = 0;
    for (Py_ssize_t i = 0; i < len; i++) {
        int digit = hex_digit(p[i]);
        if (digit < 0 || (lowercase_only && p[i] >= 'A' && p[i] <= 'F'))
            return -1;
        value = value << 4 | (uint64_t)digit;
    }
    *out = value;
    return 0;
}

/* digest.digest_fingerprint: a well-formed "sha256:<64 hex>" (digest.sha256_digest: hex
 * of either case) gives its first 16 digits as an int; any other digest is its own
 * fingerprint. New reference. */
static PyObject *
digest_fingerprint(PyObject *digest)
{
    if (PyUnicode_IS_ASCII(digest) && PyUnicode_GET_LENGTH(digest) == 71) {
        const char *p = (const char *)PyUnicode_1BYTE_DATA(digest);
        int well_formed = memcmp(p, "sha256:", 7) == 0;
        for (int i = 7; well_formed && i < 71; i++)
            well_formed = hex_digit(p[i]) >= 0;
        if (well_formed) {
            uint64_t value = 0;
            for (int i = 7; i < 23; i++)
                value = value << 4 | (uint64_t)hex_digit(p[i]);
            return PyLong_FromUnsignedLongLong(value);
        }
    }
    return Py_NewRef(digest);
}

/* digest.fingerprint: the first 64 bits of the SHA-256 of the value's canonical JSON. */
static PyObject *
fingerprint(Fold *self, PyObject *value)
{
    PyObject *args[2] = {value, self->dumps_option};
    PyObject *canonical = PyObject_Vectorcall(self->dumps, args, 1, OPTION_KEYWORD);
    if (canonical == NULL || !PyBytes_Check(canonical)) {
        /* what orjson refuses (integers beyond 64 bits, say) the reference digests by repr */
        PyErr_Clear();
        Py_XDECREF(canonical);
        return PyObject_CallOneArg(self->fingerprint, value);
    }
    uint64_t prefix = sha256_prefix((const unsigned char *)PyBytes_AS_STRING(canonical),
                                    (size_t)PyBytes_GET_SIZE(canonical), sha256_fast_block);
    Py_DECREF(canonical);
    return PyLong_FromUnsignedLongLong(prefix);
}

static PyObject *
get(PyObject *record, PyObject *name)
{
    return PyDict_GetItemWithError(record, name); /* borrowed; NULL when absent */
}

/* record.is_recorded: the outcome is in the record, by value, reference or digest. */
static int
is_recorded(Fold *self, PyObject *record)
{
    PyObject *result = get(record, S_RESULT);
    if (result != NULL) {
        int differs = PyObject_RichCompareBool(result, self->redacted, Py_NE);
        if (differs < 0)
            return -1;
        if (differs && get(record, S_REDACTED) != Py_True)
            return 1;
    }
    PyObject *ref = get(record, S_RESULT_REF);
    int truth = ref == NULL ? 0 : PyObject_IsTrue(ref);
    if (truth != 0)
        return truth;
    PyObject *digest = get(record, S_RESULT_DIGEST);
    return digest == NULL ? 0 : PyObject_IsTrue(digest);
}

/* record.outcome_fingerprint. New reference (None when nothing identifies the outcome). */
static PyObject *
outcome_fingerprint(Fold *self, PyObject *record)
{
    PyObject *given = get(record, S_RESULT_DIGEST);
    if (given != NULL && PyUnicode_CheckExact(given) && PyUnicode_GET_LENGTH(given) > 0)
        return digest_fingerprint(given);
    PyObject *result = get(record, S_RESULT);
    if (result != NULL) {
        int differs = PyObject_RichCompareBool(result, self->redacted, Py_NE);
        if (differs < 0)
            return NULL;
        if (differs)
            return fingerprint(self, result);
    }
    Py_RETURN_NONE;
}

/* state._pack_attempts: small attempt numbers as a bit mask. New reference. */
static PyObject *
pack_attempts(PyObject *attempts)
{
    uint64_t mask = 0;
    if (!PyFrozenSet_CheckExact(attempts))
        return Py_NewRef(attempts);
    PyObject *iterator = PyObject_GetIter(attempts), *attempt;
    if (iterator == NULL)
        return NULL;
    while ((attempt = PyIter_Next(iterator)) != NULL) {
        long n = PyLong_CheckExact(attempt) ? PyLong_AsLong(attempt) : -1;
        Py_DECREF(attempt);
        if (n < 1 || n > 62) {
            PyErr_Clear();
            Py_DECREF(iterator);
            return Py_NewRef(attempts);
        }
        mask |= (uint64_t)1 << n;
    }
    Py_DECREF(iterator);
    return PyErr_Occurred() ? NULL : PyLong_FromUnsignedLongLong(mask);
}

static PyObject *
new_named_tuple(PyTypeObject *type, PyObject **items, Py_ssize_t n)
{
    PyObject *tuple = type->tp_alloc(type, n);
    if (tuple == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(items[i]));
    return tuple;
}

/* What one fold works with: the reference's local variables. */
typedef struct {
    PyObject *session, *record, *where, *prior;
    PyObject *here; /* the record's own location (where may become the action's first) */
    PyObject *action_id, *status, *kind, *incarnation; /* owned */
    PyObject *outcome, *key, *attempts;                 /* owned */
    unsigned long flags;
} Action;

static void
action_clear(Action *a)
{
    Py_CLEAR(a->action_id);
    Py_CLEAR(a->status);
    Py_CLEAR(a->kind);
    Py_CLEAR(a->incarnation);
    Py_CLEAR(a->outcome);
    Py_CLEAR(a->key);
    Py_CLEAR(a->attempts);
}

/* The start of the reference: what the action was, from the record and the prior memory.
 * 1 when the inputs are not what the fast path reads (nothing changed yet). */
static int
begin(Fold *self, Action *a)
{
    PyObject *action_id = get(a->record, S_ACTION_ID), *status = get(a->record, S_STATUS);
    if (action_id == NULL || status == NULL || !PyUnicode_CheckExact(action_id) || !PyUnicode_CheckExact(status))
        return PyErr_Occurred() ? -1 : 1;
    PyObject *incarnation = get(a->record, S_INCARNATION);
    if (a->prior == Py_None) {
        PyObject *kind = get(a->record, S_KIND);
        if (kind == NULL)
            return PyErr_Occurred() ? -1 : 1;
        a->action_id = Py_NewRef(action_id);
        PyUnicode_InternInPlace(&a->action_id);
        a->kind = Py_NewRef(kind);
        a->incarnation = Py_NewRef(incarnation ? incarnation : Py_None);
        a->outcome = Py_NewRef(Py_None);
        a->key = Py_NewRef(Py_None);
        a->attempts = Py_NewRef(self->no_attempts);
        a->flags = 0;
    } else {
        PyObject **prior = &PyTuple_GET_ITEM(a->prior, 0);
        int retryable = PyObject_IsTrue(prior[5]), recorded = PyObject_IsTrue(prior[7]),
            effect_done = PyObject_IsTrue(prior[9]);
        if (retryable < 0 || recorded < 0 || effect_done < 0)
            return -1;
        a->action_id = Py_NewRef(action_id);
        a->kind = Py_NewRef(prior[0]);
        /* absent or null: the run that last wrote it goes on; a replay executes nothing,
         * so the action stays the run's that executed it */
        int replayed = get(a->record, S_REPLAYED) == Py_True;
        a->incarnation = Py_NewRef(incarnation != NULL && incarnation != Py_None && !replayed ? incarnation : prior[3]);
        a->outcome = Py_NewRef(prior[8]);
        a->key = Py_NewRef(prior[6]);
        a->attempts = Py_NewRef(prior[4]);
        a->flags = (retryable ? self->retryable : 0) | (recorded ? self->recorded : 0)
                 | (effect_done ? self->effect_done : 0);
        if (PyTuple_GET_ITEM(a->where, 3) == Py_None)
            a->where = prior[1]; /* a logged action is cited where it first appeared */
    }
    a->status = Py_NewRef(status);
    return 0;
}

/* The flags and the outcome this record adds. */
static int
observe(Fold *self, Action *a)
{
    if (get(a->record, S_RETRYABLE) == Py_True)
        a->flags |= self->retryable;
    /* a replay too: it serves the outcome recorded when the action executed, which the
     * session may never have seen (SessionState.remember) */
    if (PyUnicode_CompareWithASCIIString(a->status, "ok") != 0)
        return PyErr_Occurred() ? -1 : 0;
    if (!(a->flags & self->recorded)) {
        int recorded = is_recorded(self, a->record);
        if (recorded < 0)
            return -1;
        if (recorded) {
            a->flags |= self->recorded;
            PyObject *outcome = outcome_fingerprint(self, a->record);
            if (outcome == NULL)
                return -1;
            Py_SETREF(a->outcome, outcome);
        }
    }
    int side_effecting = PySet_Contains(self->side_effecting, a->kind);
    if (side_effecting < 0)
        return -1;
    if (side_effecting || get(a->record, S_SIDE_EFFECTS) == Py_True)
        a->flags |= self->effect_done;
    return PyErr_Occurred() ? -1 : 0;
}

/* Keys, attempt numbers and prompts: the reference's own helper keeps them. An action
 * with numbered attempts is handed to it for every record, which is an attempt even
 * without attempts (the first). */
static int
keys_and_attempts(Action *a)
{
    int numbered = PyObject_IsTrue(a->attempts);
    if (numbered < 0)
        return -1;
    if (!(numbered || PyDict_Contains(a->record, S_ATTEMPTS) > 0
          || PyDict_Contains(a->record, S_IDEMPOTENCY_KEY) > 0 || PyDict_Contains(a->record, S_PROMPT_DIGEST) > 0))
        return PyErr_Occurred() ? -1 : 0;
    PyObject *seen = a->prior == Py_None ? Py_False : Py_True;
    PyObject *pair = PyObject_CallMethodObjArgs(a->session, M_KEY_AND_ATTEMPTS, a->record, a->here,
                                                a->action_id, a->key, a->attempts, seen, NULL);
    if (pair == NULL)
        return -1;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "_remember_key_and_attempts must return (key, attempts)");
        return -1;
    }
    Py_SETREF(a->key, Py_NewRef(PyTuple_GET_ITEM(pair, 0)));
    Py_SETREF(a->attempts, Py_NewRef(PyTuple_GET_ITEM(pair, 1)));
    Py_DECREF(pair);
    return 0;
}

/* The outcome fingerprint, the key and the attempt numbers beside the packed action. */
static int
store_details(Fold *self, Action *a, PyObject *details)
{
    PyObject *outcome_detail = Py_None;
    if (PyLong_CheckExact(a->outcome))
        a->flags |= self->has_outcome;
    else
        outcome_detail = a->outcome; /* a given digest that is not SHA-256: kept as it is */
    int attempted = PyObject_IsTrue(a->attempts);
    if (attempted < 0)
        return -1;
    if (a->key != Py_None || attempted) {
        a->flags |= self->has_details;
        PyObject *packed = pack_attempts(a->attempts);
        if (packed == NULL)
            return -1;
        PyObject *items[3] = {outcome_detail, a->key, packed};
        PyObject *entry = new_named_tuple((PyTypeObject *)self->details_type, items, 3);
        Py_DECREF(packed);
        if (entry == NULL)
            return -1;
        int failed = PyDict_SetItem(details, a->action_id, entry);
        Py_DECREF(entry);
        return failed;
    }
    if (outcome_detail != Py_None) {
        a->flags |= self->has_details;
        return PyDict_SetItem(details, a->action_id, outcome_detail);
    }
    return 0;
}

/* The position packed with the action: a line number, or a span id read as hex.
 * 1 when only the reference's _pack can say. */
static int
position_of(PyObject *where, uint64_t *position)
{
    PyObject *line = PyTuple_GET_ITEM(where, 1), *span_id = PyTuple_GET_ITEM(where, 3);
    if (span_id != Py_None)
        return parse_hex(span_id, position, 0) < 0 ? 1 : 0;
    if (line == Py_None) {
        *position = 0;
        return 0;
    }
    if (!PyLong_CheckExact(line))
        return 1;
    long long value = PyLong_AsLongLong(line);
    if (value < 0) {
        PyErr_Clear();
        return 1;
    }
    *position = (uint64_t)value;
    return 0;
}

/* Symbols.prefix through its cache: kind, status and file packed. New reference; None
 * when the symbol table is full. */
static PyObject *
prefix_of(PyObject *symbols, Action *a)
{
    PyObject *file = PyTuple_GET_ITEM(a->where, 0), *line = PyTuple_GET_ITEM(a->where, 1);
    if (PyTuple_GET_ITEM(a->where, 3) != Py_None) {
        file = Py_None;
    } else {
        int named = PyObject_IsTrue(file);
        if (named < 0)
            return NULL;
        if (!named)
            file = line != Py_None ? DASH : Py_None;
    }
    PyObject *combination = PyTuple_Pack(3, a->kind, a->status, file);
    if (combination == NULL)
        return NULL;
    PyObject *prefixes = PyObject_GetAttr(symbols, A_PREFIXES), *prefix = NULL;
    if (prefixes != NULL) {
        prefix = Py_XNewRef(PyDict_GetItemWithError(prefixes, combination));
        Py_DECREF(prefixes);
    }
    Py_DECREF(combination);
    if (prefix == NULL && !PyErr_Occurred())
        prefix = PyObject_CallMethodObjArgs(symbols, M_PREFIX, a->kind, a->status, file, NULL);
    return prefix;
}

/* The incarnation's packed number, as the session caches it. New reference; None when
 * the session's incarnation table is full. */
static PyObject *
incarnation_number(Fold *self, Action *a)
{
    PyObject *cached = PyObject_GetAttr(a->session, A_INCARNATION);
    if (cached == NULL)
        return NULL;
    if (!PyTuple_Check(cached) || PyTuple_GET_SIZE(cached) != 2) {
        Py_DECREF(cached);
        PyErr_SetString(PyExc_TypeError, "SessionState.incarnation must be a (text, number) pair");
        return NULL;
    }
    int changed = PyObject_RichCompareBool(a->incarnation, PyTuple_GET_ITEM(cached, 0), Py_NE);
    if (changed <= 0) {
        PyObject *number = changed < 0 ? NULL : Py_NewRef(PyTuple_GET_ITEM(cached, 1));
        Py_DECREF(cached);
        return number;
    }
    Py_DECREF(cached);
    PyObject *found = PyObject_CallMethodObjArgs(a->session, M_INCARNATION_INDEX, a->incarnation, NULL);
    if (found == NULL || found == Py_None)
        return found;
    long index = PyLong_AsLong(found);
    Py_DECREF(found);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    uint64_t words[WORDS] = {0};
    or_shifted(words, (uint64_t)index + 1, self->incarnation_shift);
    PyObject *number = int_from_words(words);
    if (number == NULL)
        return NULL;
    PyObject *pair = PyTuple_Pack(2, a->incarnation, number);
    if (pair == NULL || PyObject_SetAttr(a->session, A_INCARNATION, pair) < 0) {
        Py_XDECREF(pair);
        Py_DECREF(number);
        return NULL;
    }
    Py_DECREF(pair);
    return number;
}

/* The reference's SessionState._pack, then an int outcome shifted in as the reference
 * does: for positions and outcomes that 64-bit words cannot hold. New reference. */
static PyObject *
pack_by_reference(Fold *self, Action *a)
{
    PyObject *flags = PyLong_FromUnsignedLong(a->flags);
    if (flags == NULL)
        return NULL;
    PyObject *packed = PyObject_CallMethodObjArgs(a->session, M_PACK, a->kind, a->status, a->incarnation,
                                                  a->where, flags, NULL);
    Py_DECREF(flags);
    if (packed == NULL || !PyLong_CheckExact(a->outcome))
        return packed;
    int nonzero = PyObject_IsTrue(packed);
    if (nonzero < 0)
        Py_CLEAR(packed);
    if (nonzero <= 0)
        return packed;
    PyObject *shift = PyLong_FromLong(self->outcome_shift);
    PyObject *shifted = shift ? PyNumber_Lshift(a->outcome, shift) : NULL;
    Py_XDECREF(shift);
    PyObject *combined = shifted ? PyNumber_Or(packed, shifted) : NULL;
    Py_XDECREF(shifted);
    Py_DECREF(packed);
    return combined;
}

/* SessionState._pack, then the outcome: the action as one int, 0 when it cannot be
 * packed. New reference. */
static PyObject *
pack(Fold *self, Action *a)
{
    uint64_t position, outcome = 0;
    int outcome_is_int = PyLong_CheckExact(a->outcome);
    if (outcome_is_int) {
        outcome = PyLong_AsUnsignedLongLong(a->outcome);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return pack_by_reference(self, a);
        }
    }
    if (position_of(a->where, &position))
        return pack_by_reference(self, a);
    PyObject *symbols = PyObject_GetAttr(a->session, A_SYMBOLS);
    if (symbols == NULL)
        return NULL;
    uint64_t words[WORDS] = {a->flags};
    PyObject *prefix = prefix_of(symbols, a), *number = NULL;
    int status = prefix == NULL ? -1 : prefix == Py_None ? 1 : or_int(words, prefix);
    if (status == 0 && a->incarnation != Py_None) {
        number = incarnation_number(self, a);
        status = number == NULL ? -1 : number == Py_None ? 1 : or_int(words, number);
    }
    Py_XDECREF(prefix);
    Py_XDECREF(number);
    Py_DECREF(symbols);
    if (status < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_SystemError, "a packed prefix is wider than 128 bits");
        return NULL;
    }
    if (status > 0) /* a symbol table is full: the checker's or the session's incarnations */
        return PyLong_FromLong(0);
    or_shifted(words, position, self->position_shift);
    if (words[0] == 0 && words[1] == 0 && words[2] == 0 && words[3] == 0)
        return PyLong_FromLong(0);
    if (outcome_is_int)
        or_shifted(words, outcome, self->outcome_shift);
    return int_from_words(words);
}

static int
store_action(Fold *self, Action *a, PyObject *actions)
{
    PyObject *packed = pack(self, a);
    if (packed == NULL)
        return -1;
    int nonzero = PyObject_IsTrue(packed);
    if (nonzero == 0) {
        Py_DECREF(packed);
        PyObject *items[10] = {
            a->kind, a->where, a->status, a->incarnation, a->attempts,
            a->flags & self->retryable ? Py_True : Py_False, a->key,
            a->flags & self->recorded ? Py_True : Py_False, a->outcome,
            a->flags & self->effect_done ? Py_True : Py_False,
        };
        packed = new_named_tuple((PyTypeObject *)self->memory_type, items, 10);
        if (packed == NULL)
            return -1;
    } else if (nonzero < 0) {
        Py_DECREF(packed);
        return -1;
    }
    int failed = PyDict_SetItem(actions, a->action_id, packed);
    Py_DECREF(packed);
    return failed;
}

/* Past max_actions, the oldest action id is forgotten with its details, by the session
   (SessionState.forget_oldest_action, which looks the oldest up a batch at a time). */
static int
trim(PyObject *session, PyObject *actions)
{
    PyObject *limit = PyObject_GetAttr(session, A_MAX_ACTIONS);
    if (limit == NULL)
        return -1;
    Py_ssize_t max_actions = PyLong_AsSsize_t(limit);
    Py_DECREF(limit);
    if (max_actions == -1 && PyErr_Occurred())
        return -1;
    if (PyDict_GET_SIZE(actions) <= max_actions)
        return 0;
    PyObject *done = PyObject_CallMethodNoArgs(session, M_FORGET_OLDEST_ACTION);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

static int
fold(Fold *self, Action *a)
{
    int status = begin(self, a);
    if (status != 0)
        return status;
    if (observe(self, a) < 0 || keys_and_attempts(a) < 0)
        return -1;
    if (!PyUnicode_CheckExact(a->incarnation))
        Py_SETREF(a->incarnation, Py_NewRef(Py_None));
    PyObject *actions = PyObject_GetAttr(a->session, A_ACTIONS);
    PyObject *details = actions ? PyObject_GetAttr(a->session, A_DETAILS) : NULL;
    int failed = details == NULL || !PyDict_CheckExact(actions) || !PyDict_CheckExact(details);
    if (!failed)
        failed = store_details(self, a, details) < 0 || store_action(self, a, actions) < 0
              || (a->prior == Py_None && trim(a->session, actions) < 0);
    else if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "SessionState.actions and .details must be dicts");
    Py_XDECREF(actions);
    Py_XDECREF(details);
    return failed ? -1 : 0;
}

/* A location as the fold reads it: a tuple (file, line, trace_id, span_id). */
static int
is_location(PyObject *where)
{
    return PyTuple_Check(where) && PyTuple_GET_SIZE(where) == 4;
}

static PyObject *
Fold_remember(Fold *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "remember(session, record, where, prior) takes 4 arguments");
        return NULL;
    }
    if (self->python_remember == NULL) { /* made by Fold.__new__ without __init__ */
        PyErr_SetString(PyExc_RuntimeError, "Fold is not initialised");
        return NULL;
    }
    Action a = {.session = args[0], .record = args[1], .where = args[2], .prior = args[3], .here = args[2]};
    int usual = PyDict_CheckExact(a.record) && is_location(a.where)
             && (a.prior == Py_None
                 || (PyTuple_Check(a.prior) && PyTuple_GET_SIZE(a.prior) == 10
                     && is_location(PyTuple_GET_ITEM(a.prior, 1)))); /* prior.where may stand in for where */
    int status = usual ? fold(self, &a) : 1;
    action_clear(&a);
    if (status < 0)
        return NULL;
    if (status > 0)
        return PyObject_Vectorcall(self->python_remember, args, 4, NULL);
    Py_RETURN_NONE;
}

static int
Fold_init(Fold *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"memory_type", "details_type", "python_remember", "side_effecting", "redacted",
                            "no_attempts", "dumps", "dumps_option", "fingerprint", "flag_bits",
                            "incarnation_shift", "outcome_shift", "position_shift", NULL};
    PyObject *flag_bits;
    Fold given = {0}; /* set in self only once all of it is checked: a failed __init__ changes nothing */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!$OO!UO!OOOO!iii:Fold", names, &PyType_Type,
                                     &given.memory_type, &PyType_Type, &given.details_type, &given.python_remember,
                                     &PyFrozenSet_Type, &given.side_effecting, &given.redacted, &PyFrozenSet_Type,
                                     &given.no_attempts, &given.dumps, &given.dumps_option, &given.fingerprint,
                                     &PyTuple_Type, &flag_bits, &given.incarnation_shift, &given.outcome_shift,
                                     &given.position_shift))
        return -1;
    unsigned long *flags[5] = {&given.retryable, &given.recorded, &given.effect_done, &given.has_details,
                               &given.has_outcome};
    if (PyTuple_GET_SIZE(flag_bits) != 5) {
        PyErr_SetString(PyExc_ValueError, "flag_bits: expected (retryable, recorded, effect_done, has_details, has_outcome)");
        return -1;
    }
    for (int i = 0; i < 5; i++) {
        *flags[i] = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(flag_bits, i));
        if (PyErr_Occurred())
            return -1;
    }
    if (given.incarnation_shift < 0 || given.incarnation_shift > 64 || given.outcome_shift < 0
        || given.outcome_shift > 128 || given.outcome_shift + 64 > given.position_shift
        || given.position_shift > 64 * (WORDS - 1)) {
        PyErr_SetString(PyExc_ValueError, "the packed layout does not fit the native fold's 256 bits");
        return -1;
    }
#define TAKE(name) Py_XSETREF(self->name, Py_NewRef(given.name));
    FOLD_OBJECTS(TAKE)
#undef TAKE
    self->retryable = given.retryable;
    self->recorded = given.recorded;
    self->effect_done = given.effect_done;
    self->has_details = given.has_details;
    self->has_outcome = given.has_outcome;
    self->incarnation_shift = given.incarnation_shift;
    self->outcome_shift = given.outcome_shift;
    self->position_shift = given.position_shift;
    return 0;
}

static int
Fold_traverse(Fold *self, visitproc visit, void *arg)
{
#define VISIT(name) Py_VISIT(self->name);
    FOLD_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
Fold_clear(Fold *self)
{
#define CLEAR(name) Py_CLEAR(self->name);
    FOLD_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void
Fold_dealloc(Fold *self)
{
    PyObject_GC_UnTrack(self);
    Fold_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
sha256_prefix_py(PyObject *module, PyObject *args)
{
    Py_buffer view;
    int accelerated = 1;
    if (!PyArg_ParseTuple(args, "y*|p:sha256_prefix", &view, &accelerated))
        return NULL;
    uint64_t prefix = sha256_prefix((const unsigned char *)view.buf, (size_t)view.len,
                                    accelerated ? sha256_fast_block : sha256_block);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(prefix);
}

static PyMethodDef Fold_methods[] = {
    {"remember", (PyCFunction)(void (*)(void))Fold_remember, METH_FASTCALL,
     "remember(session, record, where, prior): SessionState.remember(session, record, where, prior), "
     "in C."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FoldType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "durable_sessions._memory.Fold",
    .tp_basicsize = sizeof(Fold),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Folds checked actions into SessionState memory, as SessionState.remember does.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Fold_init,
    .tp_traverse = (traverseproc)Fold_traverse,
    .tp_clear = (inquiry)Fold_clear,
    .tp_dealloc = (destructor)Fold_dealloc,
    .tp_methods = Fold_methods,
};

static PyMethodDef module_functions[] = {
    {"sha256_prefix", (PyCFunction)sha256_prefix_py, METH_VARARGS,
     "sha256_prefix(data, accelerated=True) -> int: the first 64 bits of SHA-256(data), big-endian; "
     "accelerated=False uses the portable code even where the CPU's SHA extensions are used."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "durable_sessions._memory",
    .m_doc = "Optional native fold of checked actions into session memory (see durable_sessions.native).",
    .m_size = -1,
    .m_methods = module_functions,
};

PyMODINIT_FUNC
PyInit__memory(void)
{
    if (PyType_Ready(&FoldType) < 0)
        return NULL;
#ifdef HAVE_SHA_NI_PATH
    if (cpu_has_sha_ni())
        sha256_fast_block = sha256_block_ni;
#endif
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(S_ACTION_ID, "action_id");
    INTERN(S_STATUS, "status");
    INTERN(S_KIND, "kind");
    INTERN(S_INCARNATION, "incarnation");
    INTERN(S_RETRYABLE, "retryable");
    INTERN(S_REPLAYED, "replayed");
    INTERN(S_SIDE_EFFECTS, "side_effects");
    INTERN(S_RESULT, "result");
    INTERN(S_REDACTED, "redacted");
    INTERN(S_RESULT_REF, "result_ref");
    INTERN(S_RESULT_DIGEST, "result_digest");
    INTERN(S_ATTEMPTS, "attempts");
    INTERN(S_IDEMPOTENCY_KEY, "idempotency_key");
    INTERN(S_PROMPT_DIGEST, "prompt_digest");
    INTERN(S_OPTION, "option");
    INTERN(A_ACTIONS, "actions");
    INTERN(A_DETAILS, "details");
    INTERN(A_SYMBOLS, "symbols");
    INTERN(A_PREFIXES, "prefixes");
    INTERN(A_INCARNATION, "incarnation");
    INTERN(A_MAX_ACTIONS, "max_actions");
    INTERN(M_PREFIX, "prefix");
    INTERN(M_INCARNATION_INDEX, "incarnation_index");
    INTERN(M_PACK, "_pack");
    INTERN(M_KEY_AND_ATTEMPTS, "_remember_key_and_attempts");
    INTERN(M_FORGET_OLDEST_ACTION, "forget_oldest_action");
    INTERN(DASH, "-");
#undef INTERN
    if ((OPTION_KEYWORD = PyTuple_Pack(1, S_OPTION)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FoldType);
    if (PyModule_AddIntConstant(m, "SHA_EXTENSIONS", sha256_fast_block != sha256_block) < 0
        || PyModule_AddObject(m, "Fold", (PyObject *)&FoldType) < 0) {
        Py_DECREF(&FoldType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

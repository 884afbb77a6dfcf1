/*
 * durable_sessions._native: the span processor's per-span work, where it is hot.
 *
 * Optional fast paths, each with a Python path that stays the reference: Handoff
 * (on_end with checking="process"), SessionCopier (on_start), route_lines (the
 * parallel offline check's line routing) and mark_bad_strings (bad_text.marked: the
 * strings of an OTLP/JSON body that are not UTF-8 text).
 *
 * Handoff hands ended spans to the checker process cheaply.
 *
 * The pure-Python hand-over (durable_sessions.offload) queues a tuple per span and has a
 * writer thread marshal and send the queue. Both halves hold the GIL, so the application
 * thread pays for them. This accelerator reads the few fields the checker needs from an
 * SDK span, encodes them straight into marshal's wire format (so the checker process
 * still reads frames with marshal.loads), and sends the bytes from a native thread that
 * never takes the GIL.
 *
 * A Handoff writes frames to a file descriptor it duplicates: a 4-byte little-endian
 * length, then a marshalled list of messages. It never raises into the span's code path:
 * put_span answers HANDED (queued, dropped and counted, or not an action),
 * NEW_RESOURCE (the span's resource is not the one last declared: nothing was queued)
 * or UNSUPPORTED (not an SDK span, or a value this encoder does not write: nothing was
 * queued), and the caller takes the Python path for the last two.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <marshal.h>

#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { HANDED = 0, NEW_RESOURCE = 1, UNSUPPORTED = 2 };

/* marshal's type codes (Python/marshal.c); version 2, which has no back-references,
 * so separately encoded messages can be concatenated into one list. */
#define TYPE_NULL '0'
#define TYPE_NONE 'N'
#define TYPE_FALSE 'F'
#define TYPE_TRUE 'T'
#define TYPE_INT 'i'
#define TYPE_LONG 'l'
#define TYPE_BINARY_FLOAT 'g'
#define TYPE_UNICODE 'u'
#define TYPE_TUPLE '('
#define TYPE_LIST '['
#define TYPE_DICT '{'
#define FRAME_HEADER 9 /* frame length (4), list type (1), item count (4) */

/* -- growable byte buffers ------------------------------------------------------------ */

typedef struct {
    char *data;
    size_t len;
    size_t cap;
    char small[512];
} Scratch; /* one span's encoding, on the encoding thread's stack */

static int
scratch_reserve(Scratch *s, size_t extra)
{
    if (s->len + extra <= s->cap)
        return 0;
    size_t cap = s->cap * 2;
    while (cap < s->len + extra)
        cap *= 2;
    char *data = s->data == s->small ? PyMem_RawMalloc(cap) : PyMem_RawRealloc(s->data, cap);
    if (data == NULL)
        return -1;
    if (s->data == s->small)
        memcpy(data, s->small, s->len);
    s->data = data;
    s->cap = cap;
    return 0;
}

static void
scratch_init(Scratch *s)
{
    s->data = s->small;
    s->len = 0;
    s->cap = sizeof s->small;
}

static void
scratch_free(Scratch *s)
{
    if (s->data != s->small)
        PyMem_RawFree(s->data);
}

static int
put_byte(Scratch *s, char c)
{
    if (scratch_reserve(s, 1) < 0)
        return -1;
    s->data[s->len++] = c;
    return 0;
}

static int
put_raw(Scratch *s, const void *data, size_t len)
{
    if (scratch_reserve(s, len) < 0)
        return -1;
    memcpy(s->data + s->len, data, len);
    s->len += len;
    return 0;
}

static void
store_u32(char *p, uint32_t x)
{
    p[0] = (char)(x & 0xff);
    p[1] = (char)((x >> 8) & 0xff);
    p[2] = (char)((x >> 16) & 0xff);
    p[3] = (char)((x >> 24) & 0xff);
}

static int
put_u32(Scratch *s, char type, uint32_t x)
{
    if (scratch_reserve(s, 5) < 0)
        return -1;
    s->data[s->len] = type;
    store_u32(s->data + s->len + 1, x);
    s->len += 5;
    return 0;
}

/* -- marshal encoding of attribute values ------------------------------------------- */

/* Each encoder returns 0 when written, 1 when the value is not one this encoder writes
 * (the caller then takes the Python path), -1 on a memory error. None of them runs
 * Python code, so no other thread can run while a span is being encoded. */

static int
put_magnitude(Scratch *s, int negative, unsigned long long hi, unsigned long long lo)
{
    /* TYPE_LONG: the count of 15-bit digits (negative for a negative number), then the
     * digits from the least significant, the last one non-zero. */
    uint16_t digits[9];
    int n = 0;
    while (hi != 0 || lo != 0) {
        digits[n++] = (uint16_t)(lo & 0x7fff);
        lo = (lo >> 15) | ((hi & 0x7fff) << 49);
        hi >>= 15;
    }
    if (put_u32(s, TYPE_LONG, (uint32_t)(negative ? -n : n)) < 0 || scratch_reserve(s, 2 * (size_t)n) < 0)
        return -1;
    for (int i = 0; i < n; i++) {
        s->data[s->len++] = (char)(digits[i] & 0xff);
        s->data[s->len++] = (char)(digits[i] >> 8);
    }
    return 0;
}

static int
put_int(Scratch *s, PyObject *value)
{
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow == 0) {
        if (x == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (x >= INT32_MIN && x <= INT32_MAX)
            return put_u32(s, TYPE_INT, (uint32_t)(int32_t)x);
        unsigned long long magnitude = x < 0 ? (unsigned long long)(-(x + 1)) + 1 : (unsigned long long)x;
        return put_magnitude(s, x < 0, 0, magnitude);
    }
    if (overflow < 0)
        return 1; /* below -2**63: rare enough for the Python path */
    /* Trace ids are 128-bit. */
    unsigned char bytes[16];
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t needed = PyLong_AsNativeBytes(value, bytes, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
    if (needed < 0 || needed > 16) {
        PyErr_Clear();
        return 1;
    }
#else
    if (_PyLong_AsByteArray((PyLongObject *)value, bytes, 16, 1, 0) < 0) {
        PyErr_Clear(); /* 2**128 or more */
        return 1;
    }
#endif
    unsigned long long lo = 0, hi = 0;
    for (int i = 7; i >= 0; i--) {
        lo = (lo << 8) | bytes[i];
        hi = (hi << 8) | bytes[i + 8];
    }
    return put_magnitude(s, 0, hi, lo);
}

static int
put_str(Scratch *s, PyObject *value)
{
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(value, &size);
    if (utf8 == NULL) { /* lone surrogates: marshal writes them, UTF-8 cannot */
        PyErr_Clear();
        return 1;
    }
    if (size > INT32_MAX)
        return 1;
    if (put_u32(s, TYPE_UNICODE, (uint32_t)size) < 0 || put_raw(s, utf8, (size_t)size) < 0)
        return -1;
    return 0;
}

static int
put_scalar(Scratch *s, PyObject *value)
{
    if (value == Py_None)
        return put_byte(s, TYPE_NONE);
    if (value == Py_True)
        return put_byte(s, TYPE_TRUE);
    if (value == Py_False)
        return put_byte(s, TYPE_FALSE);
    if (PyUnicode_CheckExact(value))
        return put_str(s, value);
    if (PyLong_CheckExact(value))
        return put_int(s, value);
    if (PyFloat_CheckExact(value)) {
        if (scratch_reserve(s, 9) < 0)
            return -1;
        s->data[s->len] = TYPE_BINARY_FLOAT;
        if (PyFloat_Pack8(PyFloat_AS_DOUBLE(value), s->data + s->len + 1, 1) < 0) {
            PyErr_Clear();
            return 1;
        }
        s->len += 9;
        return 0;
    }
    return 1;
}

static int
put_value(Scratch *s, PyObject *value)
{
    int is_tuple = PyTuple_CheckExact(value);
    if (!is_tuple && !PyList_CheckExact(value))
        return put_scalar(s, value);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
    if (n > INT32_MAX)
        return 1;
    int status = put_u32(s, is_tuple ? TYPE_TUPLE : TYPE_LIST, (uint32_t)n);
    PyObject **items = PySequence_Fast_ITEMS(value);
    for (Py_ssize_t i = 0; status == 0 && i < n; i++) {
        if (PyTuple_CheckExact(items[i]) || PyList_CheckExact(items[i]))
            return 1; /* attribute values are flat; let marshal handle the odd one */
        status = put_scalar(s, items[i]);
    }
    return status;
}

static int
put_attributes(Scratch *s, PyObject *dict)
{
    if (put_byte(s, TYPE_DICT) < 0)
        return -1;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key))
            return 1;
        int status = put_str(s, key);
        if (status == 0)
            status = put_value(s, value);
        if (status != 0)
            return status;
    }
    return put_byte(s, TYPE_NULL);
}

/* -- the state shared with the sending thread ------------------------------------------ */

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;     /* the sender waits here for bytes, a full batch or closing */
    pthread_cond_t finished; /* close() waits here for the sender to end */
    int fd;
    char *pending; /* FRAME_HEADER bytes reserved, then the encoded messages */
    size_t pending_len, pending_cap;
    uint32_t pending_count;
    unsigned long long pending_spans; /* of the pending messages, those that are spans */
    size_t batch_bytes, limit_bytes;
    uint32_t limit_count;
    double interval_s;
    int urgent, closing, done, error, refs;
    unsigned long long dropped;
    unsigned long long sent; /* spans written to fd */
} Shared;

static void
shared_release(Shared *st)
{
    pthread_mutex_lock(&st->lock);
    int last = --st->refs == 0;
    pthread_mutex_unlock(&st->lock);
    if (!last)
        return;
    if (st->fd >= 0)
        close(st->fd);
    free(st->pending);
    pthread_mutex_destroy(&st->lock);
    pthread_cond_destroy(&st->wake);
    pthread_cond_destroy(&st->finished);
    free(st);
}

static int
write_all(int fd, const char *data, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Condition variables time out on the monotonic clock where they can (not on macOS). */
#if defined(__APPLE__)
#define DEADLINE_CLOCK CLOCK_REALTIME
#else
#define DEADLINE_CLOCK CLOCK_MONOTONIC
#endif

static void
deadline_after(struct timespec *t, double seconds)
{
    /* A negative or NaN wait is none, a longer one than 10**9 s is that long: the
     * nanoseconds stay non-negative and in range (pthread_cond_timedwait refuses a
     * negative tv_nsec with EINVAL, and its callers would spin holding the lock). */
    if (!(seconds > 0))
        seconds = 0;
    else if (seconds > 1e9)
        seconds = 1e9;
    clock_gettime(DEADLINE_CLOCK, t);
    long long ns = t->tv_nsec + (long long)(seconds * 1e9);
    t->tv_sec += (time_t)(ns / 1000000000LL);
    t->tv_nsec = (long)(ns % 1000000000LL);
}

static void *
sender_main(void *arg)
{
    Shared *st = arg;
    char *out = NULL;
    size_t out_cap = 0;
    pthread_mutex_lock(&st->lock);
    for (;;) {
        while (st->pending_count == 0 && !st->closing)
            pthread_cond_wait(&st->wake, &st->lock);
        if (st->pending_count == 0)
            break; /* closing, and everything is sent */
        if (!st->closing && !st->urgent && st->pending_len < st->batch_bytes) {
            struct timespec deadline;
            deadline_after(&deadline, st->interval_s);
            while (!st->closing && !st->urgent && st->pending_len < st->batch_bytes)
                if (pthread_cond_timedwait(&st->wake, &st->lock, &deadline) == ETIMEDOUT)
                    break;
        }
        /* Take the pending bytes, leave an empty buffer in their place. */
        char *frame = st->pending;
        size_t frame_len = st->pending_len, frame_cap = st->pending_cap;
        uint32_t count = st->pending_count;
        unsigned long long spans = st->pending_spans;
        st->pending = out;
        st->pending_cap = out_cap;
        st->pending_len = FRAME_HEADER;
        st->pending_count = 0;
        st->pending_spans = 0;
        st->urgent = 0;
        pthread_mutex_unlock(&st->lock);
        store_u32(frame, (uint32_t)(frame_len - 4));
        frame[4] = TYPE_LIST;
        store_u32(frame + 5, count);
        int error = write_all(st->fd, frame, frame_len);
        out = frame;
        out_cap = frame_cap;
        pthread_mutex_lock(&st->lock);
        if (!error)
            st->sent += spans;
        if (error) {
            st->error = error;
            st->dropped += spans + st->pending_spans;
            st->pending_count = 0;
            st->pending_spans = 0;
            st->pending_len = FRAME_HEADER;
            break;
        }
    }
    close(st->fd); /* the checker reads the end of its input */
    st->fd = -1;
    st->done = 1;
    pthread_cond_broadcast(&st->finished);
    pthread_mutex_unlock(&st->lock);
    free(out);
    shared_release(st);
    return NULL;
}

/* Ask the sending thread to send what is queued and end; later messages are refused. */
static void
shared_stop(Shared *st)
{
    pthread_mutex_lock(&st->lock);
    st->closing = 1;
    pthread_cond_signal(&st->wake);
    pthread_mutex_unlock(&st->lock);
}

static void
shared_drop(Shared *st)
{
    pthread_mutex_lock(&st->lock);
    st->dropped++;
    pthread_mutex_unlock(&st->lock);
}

/* Append one encoded message; 1 when it was queued, 0 when dropped (a span is counted). */
static int
shared_append(Shared *st, const char *data, size_t len, int urgent, int is_span)
{
    int queued = 0;
    pthread_mutex_lock(&st->lock);
    /* The limits hold back spans only: a request or a resource always has room, and so
     * does one span however large, when no other span is waiting. */
    if (st->closing || st->error
        || (is_span && st->pending_spans > 0
            && (st->pending_len + len > st->limit_bytes || st->pending_count >= st->limit_count))) {
        st->dropped += is_span;
    }
    else {
        if (st->pending_len + len > st->pending_cap) {
            size_t cap = st->pending_cap ? st->pending_cap : 65536;
            while (cap < st->pending_len + len)
                cap *= 2;
            char *grown = realloc(st->pending, cap);
            if (grown == NULL) {
                st->dropped += is_span;
                pthread_mutex_unlock(&st->lock);
                return 0;
            }
            st->pending = grown;
            st->pending_cap = cap;
        }
        memcpy(st->pending + st->pending_len, data, len);
        st->pending_len += len;
        st->pending_count++;
        st->pending_spans += is_span;
        st->urgent |= urgent;
        queued = 1;
        if (st->pending_count == 1 || urgent || st->pending_len >= st->batch_bytes)
            pthread_cond_signal(&st->wake);
    }
    pthread_mutex_unlock(&st->lock);
    return queued;
}

/* -- after fork() ---------------------------------------------------------------------------- */

/* A forked child has no sending thread, and the shared lock may have been held by it at
 * the fork: a Handoff made before the fork drops (and counts) everything in the child
 * without touching the shared state. */
static volatile unsigned long fork_generation;

static void
on_fork_child(void)
{
    fork_generation++;
}

/* -- the Python type -------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Shared *st;
    pthread_t thread;
    int started;
    long span_op;
    PyObject *action_kind; /* the agent.action.kind key */
    PyObject *markers;     /* third-party marker keys (a tuple of str) */
    PyObject *prefix;      /* agent.action. */
    PyObject *error_code;  /* StatusCode.ERROR */
    PyObject *resource;    /* the resource last declared to the checker */
    int context_is_tuple;  /* SpanContext(trace_id, span_id, ...)[0:2] == (trace_id, span_id) */
    PyObject *fallback;    /* on_end's Python path, for what put_span does not hand over */
    unsigned long generation;          /* fork_generation when made */
    unsigned long long forked_dropped; /* spans dropped in a forked child */
} Handoff;

static int
forked(Handoff *self)
{
    return self->generation != fork_generation;
}

static int
handoff_append(Handoff *self, const char *data, size_t len, int urgent, int is_span)
{
    if (forked(self)) {
        self->forked_dropped += is_span;
        return 0;
    }
    return shared_append(self->st, data, len, urgent, is_span);
}

static void
handoff_drop(Handoff *self)
{
    if (forked(self))
        self->forked_dropped++;
    else
        shared_drop(self->st);
}

static PyObject *ATTR_ATTRIBUTES, *ATTR_DICT, *ATTR_MAX_LEN, *ATTR_RESOURCE, *ATTR_STATUS,
    *ATTR_STATUS_CODE, *ATTR_START, *ATTR_END, *ATTR_CONTEXT, *ATTR_TRACE_ID, *ATTR_SPAN_ID;

static int
Handoff_init(Handoff *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"fd", "span_op", "action_kind", "markers", "prefix", "error_code",
                            "batch_bytes", "limit_bytes", "limit_count", "interval_s", "context_is_tuple", NULL};
    int fd;
    Py_ssize_t batch_bytes, limit_bytes, limit_count;
    double interval_s;
    PyObject *action_kind, *markers, *prefix, *error_code;
    if (self->st != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Handoff is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ilUO!UOnnnd|p", names, &fd, &self->span_op, &action_kind,
                                     &PyTuple_Type, &markers, &prefix, &error_code, &batch_bytes,
                                     &limit_bytes, &limit_count, &interval_s, &self->context_is_tuple))
        return -1;
    if (batch_bytes <= 0 || limit_bytes <= FRAME_HEADER || limit_count <= 0 || limit_count > UINT32_MAX
        || !(interval_s > 0)) {
        PyErr_SetString(PyExc_ValueError, "batch_bytes, limit_bytes, limit_count and interval_s must be positive");
        return -1;
    }
    Shared *st = calloc(1, sizeof *st);
    if (st == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    st->pending_cap = 65536;
    st->pending = malloc(st->pending_cap);
    st->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (st->pending == NULL || st->fd < 0) {
        int error = errno;
        if (st->fd >= 0)
            close(st->fd);
        free(st->pending);
        free(st);
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_condattr_t monotonic;
    pthread_condattr_init(&monotonic);
#if !defined(__APPLE__)
    pthread_condattr_setclock(&monotonic, DEADLINE_CLOCK);
#endif
    pthread_mutex_init(&st->lock, NULL);
    pthread_cond_init(&st->wake, &monotonic);
    pthread_cond_init(&st->finished, &monotonic);
    pthread_condattr_destroy(&monotonic);
    st->pending_len = FRAME_HEADER;
    st->batch_bytes = (size_t)batch_bytes + FRAME_HEADER;
    st->limit_bytes = (size_t)limit_bytes;
    st->limit_count = (uint32_t)limit_count;
    st->interval_s = interval_s;
    st->refs = 2; /* this object and the sending thread */
    int error = pthread_create(&self->thread, NULL, sender_main, st);
    if (error) {
        st->refs = 1;
        shared_release(st);
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->st = st;
    self->started = 1;
    self->generation = fork_generation;
    Py_INCREF(action_kind);
    self->action_kind = action_kind;
    Py_INCREF(markers);
    self->markers = markers;
    Py_INCREF(prefix);
    self->prefix = prefix;
    Py_INCREF(error_code);
    self->error_code = error_code;
    Py_INCREF(Py_None);
    self->resource = Py_None;
    return 0;
}

/* Close without waiting: the thread sends what is queued, then frees the shared state. */
static void
Handoff_dealloc(Handoff *self)
{
    PyObject_GC_UnTrack(self);
    if (self->st != NULL && forked(self)) { /* no thread here, and the lock is not ours */
        if (self->st->fd >= 0)
            close(self->st->fd);
        free(self->st->pending);
        free(self->st);
    }
    else if (self->st != NULL) {
        shared_stop(self->st);
        if (self->started)
            pthread_detach(self->thread);
        shared_release(self->st);
    }
    Py_CLEAR(self->action_kind);
    Py_CLEAR(self->markers);
    Py_CLEAR(self->prefix);
    Py_CLEAR(self->error_code);
    Py_CLEAR(self->resource);
    Py_CLEAR(self->fallback);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Handoff_traverse(Handoff *self, visitproc visit, void *arg)
{
    Py_VISIT(self->resource);
    Py_VISIT(self->fallback); /* a bound method of the span processor that owns this */
    return 0;
}

static int
Handoff_clear(Handoff *self)
{
    Py_CLEAR(self->resource);
    Py_CLEAR(self->fallback);
    return 0;
}

static int
ready(Handoff *self)
{
    if (self->st == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Handoff is not initialised");
        return 0;
    }
    return 1;
}

/* True when the mapping could call the span an action (span_check.may_be_action). */
static int
may_be_action(Handoff *self, PyObject *attributes)
{
    int found = PyDict_Contains(attributes, self->action_kind);
    for (Py_ssize_t i = 0; found == 0 && i < PyTuple_GET_SIZE(self->markers); i++)
        found = PyDict_Contains(attributes, PyTuple_GET_ITEM(self->markers, i));
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (found == 0 && PyDict_Next(attributes, &pos, &key, &value)) {
        if (!PyUnicode_Check(key))
            continue;
        Py_ssize_t at = PyUnicode_Find(key, self->prefix, 0, PY_SSIZE_T_MAX, 1);
        found = at >= 0 ? 1 : (at == -1 ? 0 : -1);
    }
    return found;
}

/* A SpanContext is a tuple (trace_id, span_id, ...) whose properties read its items; the
 * items are read directly when the caller found that layout at start-up. */
static PyObject *
context_item(Handoff *self, PyObject *context, Py_ssize_t index, PyObject *name)
{
    if (self->context_is_tuple && PyTuple_Check(context) && PyTuple_GET_SIZE(context) > index) {
        PyObject *item = PyTuple_GET_ITEM(context, index);
        Py_INCREF(item);
        return item;
    }
    return PyObject_GetAttr(context, name);
}

/* The span's message: (span_op, attributes, is_error, start_ns, end_ns, trace_id, span_id,
 * limit): span_check.SpanParts after the op. */
static int
encode_span(Handoff *self, Scratch *s, PyObject *span, PyObject *bounded, PyObject *attributes)
{
    int status = 1;
    PyObject *state = NULL, *code = NULL, *start = NULL, *end = NULL, *context = NULL, *trace_id = NULL,
             *span_id = NULL, *limit = NULL;
    if ((state = PyObject_GetAttr(span, ATTR_STATUS)) == NULL
        || (state != Py_None && (code = PyObject_GetAttr(state, ATTR_STATUS_CODE)) == NULL)
        || (start = PyObject_GetAttr(span, ATTR_START)) == NULL
        || (end = PyObject_GetAttr(span, ATTR_END)) == NULL
        || (context = PyObject_GetAttr(span, ATTR_CONTEXT)) == NULL
        || (trace_id = context_item(self, context, 0, ATTR_TRACE_ID)) == NULL
        || (span_id = context_item(self, context, 1, ATTR_SPAN_ID)) == NULL
        || (limit = PyObject_GetAttr(bounded, ATTR_MAX_LEN)) == NULL) {
        PyErr_Clear();
        goto done;
    }
    if (!(start == Py_None || PyLong_CheckExact(start)) || !(end == Py_None || PyLong_CheckExact(end))
        || !PyLong_CheckExact(trace_id)
        || !PyLong_CheckExact(span_id) || !(limit == Py_None || PyLong_CheckExact(limit)))
        goto done;
    if ((status = put_u32(s, TYPE_TUPLE, 8)) != 0 || (status = put_u32(s, TYPE_INT, (uint32_t)self->span_op)) != 0
        || (status = put_attributes(s, attributes)) != 0
        || (status = put_byte(s, code != NULL && code == self->error_code ? TYPE_TRUE : TYPE_FALSE)) != 0
        || (status = start == Py_None ? put_u32(s, TYPE_INT, 0) : put_int(s, start)) != 0
        || (status = end == Py_None ? put_u32(s, TYPE_INT, 0) : put_int(s, end)) != 0
        || (status = put_int(s, trace_id)) != 0 || (status = put_int(s, span_id)) != 0
        || (status = put_scalar(s, limit)) != 0)
        goto done;
done:
    Py_XDECREF(state);
    Py_XDECREF(code);
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(context);
    Py_XDECREF(trace_id);
    Py_XDECREF(span_id);
    Py_XDECREF(limit);
    return status;
}

static long
put_span(Handoff *self, PyObject *span)
{
    long answer = UNSUPPORTED;
    PyObject *bounded = NULL, *attributes = NULL, *resource = NULL;
    Scratch s;
    scratch_init(&s);
    if ((bounded = PyObject_GetAttr(span, ATTR_ATTRIBUTES)) == NULL
        || (attributes = PyObject_GetAttr(bounded, ATTR_DICT)) == NULL) {
        PyErr_Clear();
        goto done;
    }
    if (!PyDict_CheckExact(attributes))
        goto done;
    int action = may_be_action(self, attributes);
    if (action < 0) {
        PyErr_Clear();
        goto done;
    }
    if (action == 0) {
        answer = HANDED; /* certainly not an action: nothing to send */
        goto done;
    }
    if ((resource = PyObject_GetAttr(span, ATTR_RESOURCE)) == NULL) {
        PyErr_Clear();
        goto done;
    }
    if (resource != self->resource) {
        answer = NEW_RESOURCE;
        goto done;
    }
    int status = encode_span(self, &s, span, bounded, attributes);
    if (status < 0) {
        PyErr_Clear();
        handoff_drop(self);
        answer = HANDED;
    }
    else if (status == 0) {
        handoff_append(self, s.data, s.len, 0, 1);
        answer = HANDED;
    }
done:
    scratch_free(&s);
    Py_XDECREF(bounded);
    Py_XDECREF(attributes);
    Py_XDECREF(resource);
    return answer;
}

static PyObject *
Handoff_put_span(Handoff *self, PyObject *span)
{
    if (!ready(self))
        return NULL;
    return PyLong_FromLong(put_span(self, span));
}

/* A SpanProcessor's on_end: the span handed over here, or given to the fallback. */
static PyObject *
Handoff_on_end(Handoff *self, PyObject *span)
{
    if (!ready(self))
        return NULL;
    if (put_span(self, span) != HANDED && self->fallback != NULL)
        return PyObject_CallOneArg(self->fallback, span);
    Py_RETURN_NONE;
}

static PyObject *
Handoff_send(Handoff *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"message", "urgent", NULL};
    PyObject *message;
    int urgent = 0;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", names, &message, &urgent))
        return NULL;
    /* Only spans count as dropped, as put_span's do. */
    int is_span = PyTuple_Check(message) && PyTuple_GET_SIZE(message) > 0 && PyLong_CheckExact(PyTuple_GET_ITEM(message, 0))
                  && PyLong_AsLong(PyTuple_GET_ITEM(message, 0)) == self->span_op;
    PyErr_Clear();
    PyObject *data = PyMarshal_WriteObjectToString(message, 2);
    if (data == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError))
            return NULL;
        PyErr_Clear(); /* a value marshal cannot carry */
        if (is_span)
            handoff_drop(self);
        Py_RETURN_FALSE;
    }
    int queued = handoff_append(self, PyBytes_AS_STRING(data), (size_t)PyBytes_GET_SIZE(data), urgent, is_span);
    Py_DECREF(data);
    return PyBool_FromLong(queued);
}

static PyObject *
Handoff_stop(Handoff *self, PyObject *unused)
{
    if (!ready(self))
        return NULL;
    if (!forked(self))
        shared_stop(self->st);
    Py_RETURN_NONE;
}

static PyObject *
Handoff_close(Handoff *self, PyObject *args)
{
    double timeout_s;
    if (!ready(self) || !PyArg_ParseTuple(args, "d", &timeout_s))
        return NULL;
    if (forked(self))
        Py_RETURN_TRUE; /* nothing of it runs in this process */
    Shared *st = self->st;
    int done, join = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec deadline;
    deadline_after(&deadline, timeout_s);
    shared_stop(st);
    pthread_mutex_lock(&st->lock);
    while (!st->done)
        if (pthread_cond_timedwait(&st->finished, &st->lock, &deadline) == ETIMEDOUT)
            break;
    done = st->done;
    /* One caller joins the thread: claimed under the lock, as two threads may close at
     * once (a shutdown from two threads), and a thread joined twice hung the second. */
    if (done && self->started) {
        self->started = 0;
        join = 1;
    }
    pthread_mutex_unlock(&st->lock);
    if (join)
        pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *
Handoff_get_dropped(Handoff *self, void *closure)
{
    if (!ready(self))
        return NULL;
    if (forked(self))
        return PyLong_FromUnsignedLongLong(self->forked_dropped);
    pthread_mutex_lock(&self->st->lock);
    unsigned long long dropped = self->st->dropped;
    pthread_mutex_unlock(&self->st->lock);
    return PyLong_FromUnsignedLongLong(dropped);
}

static PyObject *
Handoff_get_sent(Handoff *self, void *closure)
{
    if (!ready(self))
        return NULL;
    if (forked(self))
        return PyLong_FromLong(0); /* nothing is sent from this process */
    pthread_mutex_lock(&self->st->lock);
    unsigned long long sent = self->st->sent;
    pthread_mutex_unlock(&self->st->lock);
    return PyLong_FromUnsignedLongLong(sent);
}

/* The sender's copy of the pipe (-1 once closed). In a forked child it is read without
 * the lock, which no thread of the child holds or will release. */
static PyObject *
Handoff_get_fd(Handoff *self, void *closure)
{
    if (!ready(self))
        return NULL;
    if (forked(self))
        return PyLong_FromLong(self->st->fd);
    pthread_mutex_lock(&self->st->lock);
    int fd = self->st->fd;
    pthread_mutex_unlock(&self->st->lock);
    return PyLong_FromLong(fd);
}

static PyObject *
Handoff_get_error(Handoff *self, void *closure)
{
    if (!ready(self))
        return NULL;
    if (forked(self))
        return PyObject_CallFunction(PyExc_OSError, "is", ECHILD, "the sender was made in the parent process");
    pthread_mutex_lock(&self->st->lock);
    int error = self->st->error;
    pthread_mutex_unlock(&self->st->lock);
    if (error == 0)
        Py_RETURN_NONE;
    return PyObject_CallFunction(PyExc_OSError, "is", error, strerror(error));
}

/* The getter of an object field (its offset in Handoff is the closure); None when unset. */
static PyObject *
Handoff_get_object(Handoff *self, void *offset)
{
    PyObject *value = *(PyObject **)((char *)self + (size_t)offset);
    return Py_NewRef(value != NULL ? value : Py_None);
}

static int
Handoff_set_resource(Handoff *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "resource cannot be deleted");
        return -1;
    }
    Py_INCREF(value);
    Py_XSETREF(self->resource, value);
    return 0;
}

static PyMethodDef Handoff_methods[] = {
    {"put_span", (PyCFunction)Handoff_put_span, METH_O,
     "put_span(span) -> 0 handed over (or not an action, or dropped and counted), "
     "1 new resource, 2 unsupported (nothing queued for 1 and 2)."},
    {"on_end", (PyCFunction)Handoff_on_end, METH_O,
     "on_end(span): put_span, and the fallback for a span it did not hand over."},
    {"send", (PyCFunction)(void (*)(void))Handoff_send, METH_VARARGS | METH_KEYWORDS,
     "send(message, urgent=False) -> bool: queue a marshalable message; False if dropped "
     "(counted in dropped when it is a span message)."},
    {"stop", (PyCFunction)Handoff_stop, METH_NOARGS,
     "stop(): refuse (and count) further messages; what is queued is still sent."},
    {"close", (PyCFunction)Handoff_close, METH_VARARGS,
     "close(timeout_s) -> bool: send what is queued, then end; False if still sending at the timeout."},
    {NULL, NULL, 0, NULL},
};

static int
Handoff_set_fallback(Handoff *self, PyObject *value, void *closure)
{
    if (value != NULL && value != Py_None && !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable or None");
        return -1;
    }
    Py_XINCREF(value == Py_None ? NULL : value);
    Py_XSETREF(self->fallback, value == Py_None ? NULL : value);
    return 0;
}

static PyGetSetDef Handoff_getset[] = {
    {"fallback", (getter)Handoff_get_object, (setter)Handoff_set_fallback,
     "Called by on_end with each span put_span did not hand over (a new resource, or unsupported).", (void *)offsetof(Handoff, fallback)},
    {"dropped", (getter)Handoff_get_dropped, NULL, "Span messages not sent (queue full, unencodable, or sending stopped).", NULL},
    {"error", (getter)Handoff_get_error, NULL, "The OSError that stopped the sending, or None.", NULL},
    {"sent", (getter)Handoff_get_sent, NULL, "Span messages written to the checker process (0 in a forked child).", NULL},
    {"fd", (getter)Handoff_get_fd, NULL, "The sender's file descriptor for the pipe, -1 once it closed it.", NULL},
    {"resource", (getter)Handoff_get_object, (setter)Handoff_set_resource,
     "The resource the checker was last told about.", (void *)offsetof(Handoff, resource)},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HandoffType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "durable_sessions._native.Handoff",
    .tp_basicsize = sizeof(Handoff),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Hands ended spans to a checker process through a file descriptor.",
    .tp_traverse = (traverseproc)Handoff_traverse,
    .tp_clear = (inquiry)Handoff_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Handoff_init,
    .tp_dealloc = (destructor)Handoff_dealloc,
    .tp_methods = Handoff_methods,
    .tp_getset = Handoff_getset,
};

/* -- SessionCopier: on_start -------------------------------------------------------------- */

/* Copies the session id of the surrounding session() block onto a span that has none;
 * anything else (no SDK span, a parent span to look at, no way to read the current
 * context) is given to the fallback, the processor's Python on_start. */
typedef struct {
    PyObject_HEAD
    PyObject *session_key;      /* the session.id attribute */
    PyObject *context_key;      /* where session() keeps the id in the Context */
    PyObject *current_span_key; /* where the API keeps the current span in the Context */
    PyObject *context_var;      /* the ContextVar holding the current Context, or None */
    PyObject *fallback;
} SessionCopier;

static PyObject *ATTR_SET_ATTRIBUTE;

static int
SessionCopier_init(SessionCopier *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"session_key", "context_key", "current_span_key", "context_var", "fallback", NULL};
    PyObject *session_key, *context_key, *current_span_key, *context_var, *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "UOOOO", names, &session_key, &context_key, &current_span_key,
                                     &context_var, &fallback))
        return -1;
    if (context_var != Py_None && !PyContextVar_CheckExact(context_var)) {
        PyErr_SetString(PyExc_TypeError, "context_var must be a ContextVar or None");
        return -1;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return -1;
    }
    Py_INCREF(session_key);
    Py_XSETREF(self->session_key, session_key);
    Py_INCREF(context_key);
    Py_XSETREF(self->context_key, context_key);
    Py_INCREF(current_span_key);
    Py_XSETREF(self->current_span_key, current_span_key);
    Py_INCREF(context_var);
    Py_XSETREF(self->context_var, context_var);
    Py_INCREF(fallback);
    Py_XSETREF(self->fallback, fallback);
    return 0;
}

static int
SessionCopier_traverse(SessionCopier *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fallback);
    Py_VISIT(self->context_var);
    return 0;
}

static int
SessionCopier_clear(SessionCopier *self)
{
    Py_CLEAR(self->session_key);
    Py_CLEAR(self->context_key);
    Py_CLEAR(self->current_span_key);
    Py_CLEAR(self->context_var);
    Py_CLEAR(self->fallback);
    return 0;
}

static void
SessionCopier_dealloc(SessionCopier *self)
{
    PyObject_GC_UnTrack(self);
    SessionCopier_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 1: the span has a session id already, 0: it has none, -1: not an SDK span. */
static int
has_session(SessionCopier *self, PyObject *span)
{
    PyObject *bounded = PyObject_GetAttr(span, ATTR_ATTRIBUTES);
    PyObject *attributes = bounded == NULL ? NULL : PyObject_GetAttr(bounded, ATTR_DICT);
    int found = -1;
    if (attributes != NULL && PyDict_CheckExact(attributes))
        found = PyDict_Contains(attributes, self->session_key);
    if (found < 0)
        PyErr_Clear();
    Py_XDECREF(bounded);
    Py_XDECREF(attributes);
    return found;
}

static PyObject *PARENT_CONTEXT; /* the keyword the SDK passes parent_context by */

/* on_start(span, parent_context=None), parsed by hand: the SDK calls it for every span,
 * with a keyword, and the generic argument parser costs more than the rest of it. */
static int
on_start_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **span,
                   PyObject **parent_context)
{
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    nargs = PyVectorcall_NARGS(nargs);
    *parent_context = Py_None;
    if (nargs + nkw < 1 || nargs + nkw > 2 || nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "on_start(span, parent_context=None)");
        return -1;
    }
    *span = args[0];
    if (nargs == 2)
        *parent_context = args[1];
    else if (nkw == 1) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, 0);
        if (name != PARENT_CONTEXT && PyUnicode_Compare(name, PARENT_CONTEXT) != 0) {
            PyErr_Format(PyExc_TypeError, "on_start() got an unexpected keyword argument %R", name);
            return -1;
        }
        *parent_context = args[1];
    }
    return 0;
}

static PyObject *
SessionCopier_on_start(SessionCopier *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *span, *parent_context;
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "SessionCopier is not initialised");
        return NULL;
    }
    if (on_start_arguments(args, nargs, kwnames, &span, &parent_context) < 0)
        return NULL;
    int has = has_session(self, span);
    if (has == 1)
        Py_RETURN_NONE;
    PyObject *context = NULL;
    if (has == 0 && parent_context != Py_None) {
        context = parent_context;
        Py_INCREF(context);
    }
    else if (has == 0 && self->context_var != Py_None && PyContextVar_Get(self->context_var, NULL, &context) < 0) {
        PyErr_Clear();
        context = NULL;
    }
    if (context == NULL || !PyDict_Check(context)) {
        Py_XDECREF(context);
        if (has == 0 && self->context_var != Py_None && parent_context == Py_None)
            Py_RETURN_NONE; /* no context set at all: no session to copy */
        return PyObject_CallFunctionObjArgs(self->fallback, span, parent_context, NULL);
    }
    PyObject *session_id = PyDict_GetItemWithError(context, self->context_key);
    PyObject *result = NULL;
    if (session_id != NULL && PyUnicode_CheckExact(session_id)) {
        result = PyObject_CallMethodObjArgs(span, ATTR_SET_ATTRIBUTE, self->session_key, session_id, NULL);
        if (result == NULL) { /* let the Python path meet (and count) the error */
            PyErr_Clear();
            result = PyObject_CallFunctionObjArgs(self->fallback, span, parent_context, NULL);
        }
    }
    else if (!PyErr_Occurred() && PyDict_GetItemWithError(context, self->current_span_key) == NULL
             && !PyErr_Occurred()) {
        result = Py_None; /* no session() block and no parent span */
        Py_INCREF(result);
    }
    else {
        PyErr_Clear();
        result = PyObject_CallFunctionObjArgs(self->fallback, span, parent_context, NULL);
    }
    Py_DECREF(context);
    return result;
}

static PyMethodDef SessionCopier_methods[] = {
    {"on_start", (PyCFunction)(void (*)(void))SessionCopier_on_start, METH_FASTCALL | METH_KEYWORDS,
     "on_start(span, parent_context=None): a SpanProcessor's on_start."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SessionCopierType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "durable_sessions._native.SessionCopier",
    .tp_basicsize = sizeof(SessionCopier),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Copies the surrounding session id onto spans as they start.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SessionCopier_init,
    .tp_dealloc = (destructor)SessionCopier_dealloc,
    .tp_traverse = (traverseproc)SessionCopier_traverse,
    .tp_clear = (inquiry)SessionCopier_clear,
    .tp_methods = SessionCopier_methods,
};

/* -- route_lines: the offline check's line routing -------------------------------------------- */

/* durable_sessions.check.raw_shard_of and numbered_lines over a block of a JSONL file,
 * for a worker of a parallel check: the lines it must look at, without a Python call for
 * each line that another worker owns. */

static uint32_t crc_table[256];

static void
crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

static uint32_t
crc32_of(const unsigned char *p, size_t n) /* zlib.crc32 */
{
    uint32_t c = 0xFFFFFFFFu;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static const char LEADING_SESSION_ID[] = "{\"session_id\":\"";
static const char SESSION_ID_KEY[] = "\"session_id\"";

/* Whether "session_id" occurs in line[from:len], by its rarest byte: the underscore is
 * far less common in a JSON line than the quote the key starts with. */
static int
names_session_id(const char *line, size_t from, size_t len)
{
    const size_t key_len = sizeof SESSION_ID_KEY - 1, underscore = 8; /* "session_id" */
    const char *p = line + from + underscore, *end = line + len;
    while (p < end) {
        const char *q = memchr(p, '_', (size_t)(end - p));
        if (q == NULL || (size_t)(end - (q - underscore)) < key_len)
            return 0;
        if (memcmp(q - underscore, SESSION_ID_KEY, key_len) == 0)
            return 1;
        p = q + 1;
    }
    return 0;
}

/* Whether line holds a backslash-u escape of an ASCII letter or the underscore (code
 * points 0x40 to 0x7f): a key so written may be "session_id" again, which the parser
 * reads as the same key (check._ESCAPED_LETTER). */
static int
escapes_a_letter(const char *line, size_t len)
{
    const char *p = line, *end = line + len;
    while ((p = memchr(p, '\\', (size_t)(end - p))) != NULL) {
        if (end - p >= 5 && p[1] == 'u' && p[2] == '0' && p[3] == '0' && p[4] >= '4' && p[4] <= '7')
            return 1;
        p++;
    }
    return 0;
}

/* check.raw_shard_of: the owning shard when the bytes decide it, else -1. */
static Py_ssize_t
raw_owner(const char *line, size_t len, Py_ssize_t shards)
{
    size_t lead = sizeof LEADING_SESSION_ID - 1;
    /* raw.count(b'"session_id"') == 1: the leading key is at 1, and the count goes on
     * from where it ends (non-overlapping), at 1 + 12. */
    if (len < lead || memcmp(line, LEADING_SESSION_ID, lead) != 0
        || names_session_id(line, 1 + sizeof SESSION_ID_KEY - 1, len) || escapes_a_letter(line, len))
        return -1;
    const char *close = memchr(line + lead, '"', len - lead);
    if (close == NULL || close == line + lead || memchr(line + lead, '\\', (size_t)(close - line - lead)) != NULL)
        return -1;
    return (Py_ssize_t)(crc32_of((const unsigned char *)line + lead, (size_t)(close - line - lead)) % (size_t)shards);
}

static int
append_line(PyObject *lines, Py_ssize_t number, const char *raw, Py_ssize_t len, int decided)
{
    PyObject *bytes = raw == NULL ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize(raw, len);
    if (bytes == NULL)
        return -1;
    PyObject *item = Py_BuildValue("(nNO)", number, bytes, decided ? Py_True : Py_False);
    if (item == NULL)
        return -1;
    int status = PyList_Append(lines, item);
    Py_DECREF(item);
    return status;
}

static PyObject *
route_lines(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t number, shard, shards, max_line_bytes;
    int final;
    if (!PyArg_ParseTuple(args, "y*nnnnp", &data, &number, &shard, &shards, &max_line_bytes, &final))
        return NULL;
    PyObject *lines = PyList_New(0);
    if (lines == NULL || shards <= 0 || max_line_bytes < 0) {
        if (lines != NULL)
            PyErr_SetString(PyExc_ValueError, "shards must be positive and max_line_bytes not negative");
        Py_XDECREF(lines);
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *start = data.buf, *p = start, *end = start + data.len;
    while (p < end) {
        const char *newline = memchr(p, '\n', (size_t)(end - p));
        if (newline == NULL && !final)
            break; /* the caller brings the rest of this line with the next block */
        const char *next = newline == NULL ? end : newline + 1;
        Py_ssize_t raw_len = next - p, content = newline == NULL ? raw_len : raw_len - 1;
        number++;
        int status = 0;
        if (content > max_line_bytes)
            status = append_line(lines, number, NULL, 0, 0); /* too long: reported, never parsed */
        else {
            Py_ssize_t owner = raw_owner(p, (size_t)raw_len, shards);
            if (owner < 0 || owner == shard)
                status = append_line(lines, number, p, raw_len, owner == shard);
        }
        if (status < 0) {
            Py_DECREF(lines);
            PyBuffer_Release(&data);
            return NULL;
        }
        p = next;
    }
    Py_ssize_t consumed = p - start;
    PyBuffer_Release(&data);
    return Py_BuildValue("(Nnn)", lines, consumed, number);
}

/* -- mark_bad_strings: OTLP/JSON strings that are not UTF-8 text ------------------------------ */

/* durable_sessions.bad_text.reference_mark_bad_strings in one pass over the body: the
 * Python loop costs microseconds a string, so a body of millions of small bad strings
 * held the GIL (and stalled the sidecar) for tens of seconds. The same strings, in the
 * same words: the Python code is the reference, and a differential test holds this to it. */

enum { LONE_NONE = 0, LONE_REFUSED = -1 };

/* Each detail's text is made once and kept (a body may hold millions of marks): by lead
 * byte, and by surrogate (0xd800 to 0xdfff). */
static PyObject *byte_details[256];
static PyObject *surrogate_details[0x800];

/* The closing quote of the JSON string whose text starts at p (after its opening quote),
 * as bad_text._NEXT_STRING reads it: a backslash escapes the byte after it, whatever it
 * is. NULL when the string is unterminated. *escapes_u: whether it holds a \u escape.
 * The quote found is kept while backslashes before it are passed over, so each byte is
 * looked at a bounded number of times however many escapes the string holds. */
static const unsigned char *
string_close(const unsigned char *p, const unsigned char *end, int *escapes_u)
{
    const unsigned char *quote = NULL;
    *escapes_u = 0;
    for (;;) {
        if (quote == NULL || quote < p) {
            quote = memchr(p, '"', (size_t)(end - p));
            if (quote == NULL)
                return NULL;
        }
        const unsigned char *backslash = memchr(p, '\\', (size_t)(quote - p));
        if (backslash == NULL)
            return quote;
        if (end - backslash < 2)
            return NULL;
        *escapes_u |= backslash[1] == 'u';
        p = backslash + 2;
    }
}

/* The first byte of p[0:end] that is not ASCII, or end: eight bytes at a time, since
 * most text is ASCII. */
static const unsigned char *
skip_ascii(const unsigned char *p, const unsigned char *end)
{
    uint64_t word;
    while (end - p >= 8) {
        memcpy(&word, p, 8);
        if (word & 0x8080808080808080ULL)
            break;
        p += 8;
    }
    while (p < end && *p < 0x80)
        p++;
    return p;
}

/* Where p[0:end] stops being UTF-8 as Python's strict decoder reads it (the lead byte of
 * the first bad sequence: a stray continuation byte, an overlong form, an encoded
 * surrogate, beyond U+10FFFF, cut short), or NULL when it is UTF-8 throughout. */
static const unsigned char *
first_not_utf8(const unsigned char *p, const unsigned char *end)
{
    while ((p = skip_ascii(p, end)) < end) {
        unsigned char c = *p, low = 0x80, high = 0xbf;
        Py_ssize_t more;
        if (c >= 0xc2 && c <= 0xdf)
            more = 1;
        else if (c >= 0xe0 && c <= 0xef) {
            more = 2;
            low = c == 0xe0 ? 0xa0 : 0x80;  /* overlong */
            high = c == 0xed ? 0x9f : 0xbf; /* a surrogate */
        } else if (c >= 0xf0 && c <= 0xf4) {
            more = 3;
            low = c == 0xf0 ? 0x90 : 0x80;  /* overlong */
            high = c == 0xf4 ? 0x8f : 0xbf; /* beyond U+10FFFF */
        } else
            return p; /* a continuation byte, or a lead byte no text has */
        if (end - p <= more || p[1] < low || p[1] > high)
            return p;
        for (Py_ssize_t i = 2; i <= more; i++)
            if ((p[i] & 0xc0) != 0x80)
                return p;
        p += more + 1;
    }
    return NULL;
}

/* The four hex digits at p[0:4] (before end), or -1 when they are not. */
static long
hex4(const unsigned char *p, const unsigned char *end)
{
    if (end - p < 4)
        return -1;
    long value = 0;
    for (int i = 0; i < 4; i++) {
        unsigned char c = p[i];
        int digit = c >= '0' && c <= '9' ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
        if (digit < 0)
            return -1;
        value = value << 4 | digit;
    }
    return value;
}

/* The first lone surrogate of the JSON string p[0:end] (between its quotes, UTF-8) as
 * json.loads reads it: a \uD800-\uDBFF escape followed by a \uDC00-\uDFFF escape is a
 * pair, as CPython's _json.c scanstring pairs them (it reads the second escape's digits
 * whenever "\u" follows a high surrogate: bad digits refuse the string there). LONE_NONE
 * when it holds none, LONE_REFUSED when json.loads refuses it (a raw control character, a
 * bad escape, a short \u): no mark for it, as the reference gives none. */
static long
lone_surrogate(const unsigned char *p, const unsigned char *end)
{
    long first = LONE_NONE;
    while (p < end) {
        unsigned char c = *p;
        if (c < 0x20)
            return LONE_REFUSED;
        if (c != '\\') {
            p++;
            continue;
        }
        if (end - p < 2)
            return LONE_REFUSED;
        c = p[1];
        if (c != 'u') {
            if (c == 0 || strchr("\"\\/bfnrt", c) == NULL)
                return LONE_REFUSED;
            p += 2;
            continue;
        }
        long code = hex4(p + 2, end);
        if (code < 0)
            return LONE_REFUSED;
        p += 6;
        if (code >= 0xd800 && code <= 0xdbff && end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
            long low = hex4(p + 2, end);
            if (low < 0)
                return LONE_REFUSED;
            if (low >= 0xdc00 && low <= 0xdfff) {
                p += 6;
                continue;
            }
        }
        if (code >= 0xd800 && code <= 0xdfff && first == LONE_NONE)
            first = code;
    }
    return first;
}

/* The interned text of detail, made at its first use: slot, one of the caches. */
static PyObject *
cached_detail(PyObject **slot, const char *format, unsigned int value)
{
    if (*slot == NULL) {
        char text[48];
        snprintf(text, sizeof text, format, value);
        *slot = PyUnicode_InternFromString(text);
    }
    return *slot;
}

/* bad_text._not_text for the string p[0:end] (between its quotes): 1 with *detail (a
 * borrowed reference) when it is not UTF-8 text, 0 when it is (or json.loads refuses
 * it), -1 on a memory error. Without a \u escape a string holds no surrogate, so only
 * its bytes are looked at. */
static int
not_text(const unsigned char *p, const unsigned char *end, int escapes_u, PyObject **detail)
{
    const unsigned char *bad = first_not_utf8(p, end);
    if (bad != NULL)
        *detail = cached_detail(&byte_details[*bad], "byte 0x%02x", *bad);
    else {
        long code = escapes_u ? lone_surrogate(p, end) : LONE_NONE;
        if (code == LONE_NONE || code == LONE_REFUSED)
            return 0;
        *detail = cached_detail(&surrogate_details[code - 0xd800], "a lone surrogate escape \\u%04x", (unsigned int)code);
    }
    return *detail == NULL ? -1 : 1;
}

/* Writes the mark numbered number: quoted (a quote and the mark), the number in
 * decimal, a quote. The digits are written by hand: snprintf took half the time of a
 * body of tiny bad strings. */
static int
put_mark(Scratch *s, const Py_buffer *quoted, size_t number)
{
    char text[24], *digit = text + sizeof text;
    *--digit = '"';
    do
        *--digit = (char)('0' + number % 10);
    while ((number /= 10) != 0);
    if (put_raw(s, quoted->buf, (size_t)quoted->len) < 0 || put_raw(s, digit, (size_t)(text + sizeof text - digit)) < 0)
        return -1;
    return 0;
}

/* Marks the string body[open:close + 1] (its detail appended to *details, made at the
 * first mark), after the bytes from *copied kept as they are. */
static int
mark_string(Scratch *s, const Py_buffer *quoted, const unsigned char **copied, const unsigned char *open,
            const unsigned char *close, PyObject **details, PyObject *detail)
{
    if (*details == NULL && (*details = PyList_New(0)) == NULL)
        return -1;
    if (put_raw(s, *copied, (size_t)(open - *copied)) < 0 || put_mark(s, quoted, (size_t)PyList_GET_SIZE(*details)) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    *copied = close + 1;
    return PyList_Append(*details, detail);
}

/* The marked body and its details from the scratch buffer, the rest of the body after
 * copied kept as it is; None when no string was marked. */
static PyObject *
marked_result(Scratch *s, const unsigned char *copied, const unsigned char *end, PyObject *details)
{
    if (details == NULL)
        Py_RETURN_NONE;
    if (put_raw(s, copied, (size_t)(end - copied)) < 0 || s->len > PY_SSIZE_T_MAX) {
        Py_DECREF(details);
        return PyErr_NoMemory();
    }
    PyObject *body = PyBytes_FromStringAndSize(s->data, (Py_ssize_t)s->len);
    if (body == NULL) {
        Py_DECREF(details);
        return NULL;
    }
    return Py_BuildValue("(NN)", body, details);
}

static PyObject *
mark_bad_strings(PyObject *module, PyObject *args)
{
    Py_buffer data, quoted;
    if (!PyArg_ParseTuple(args, "y*y*", &data, &quoted))
        return NULL;
    Scratch s;
    scratch_init(&s);
    PyObject *details = NULL, *result = NULL;
    const unsigned char *p = data.buf, *end = p + data.len, *copied = p, *open;
    while ((open = memchr(p, '"', (size_t)(end - p))) != NULL) {
        int escapes_u;
        const unsigned char *close = string_close(open + 1, end, &escapes_u);
        if (close == NULL)
            break; /* unterminated: the rest is kept as it is */
        PyObject *detail;
        int status = not_text(open + 1, close, escapes_u, &detail);
        if (status < 0 || (status == 1 && mark_string(&s, &quoted, &copied, open, close, &details, detail) < 0))
            goto done;
        p = close + 1;
    }
    result = marked_result(&s, copied, end, details);
    details = NULL; /* the result's, or released */
done:
    Py_XDECREF(details);
    scratch_free(&s);
    PyBuffer_Release(&quoted);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef module_functions[] = {
    {"route_lines", (PyCFunction)route_lines, METH_VARARGS,
     "route_lines(data, number, shard, shards, max_line_bytes, final) -> (lines, consumed, number): "
     "the lines of data a parallel check's worker must look at, as (line number, raw bytes or None "
     "when too long, owned for certain); lines another worker owns are left out. Without final, "
     "a last line with no newline is left for the next call (consumed says where it starts)."},
    {"mark_bad_strings", (PyCFunction)mark_bad_strings, METH_VARARGS,
     "mark_bad_strings(body, quoted_mark) -> (marked_body, details) or None: "
     "durable_sessions.bad_text.reference_mark_bad_strings in C. Each JSON string of body "
     "that is not UTF-8 text becomes quoted_mark, its number and a quote; details[number] "
     "says why. None when body holds no such string."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "durable_sessions._native",
    .m_doc = "Optional native fast paths of the span processor, the parallel check and the "
             "marking of OTLP/JSON text that is not UTF-8 (see durable_sessions.native).",
    .m_size = -1,
    .m_methods = module_functions,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&HandoffType) < 0 || PyType_Ready(&SessionCopierType) < 0)
        return NULL;
    crc_init();
    if (pthread_atfork(NULL, NULL, on_fork_child) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(ATTR_ATTRIBUTES, "_attributes");
    INTERN(ATTR_DICT, "_dict");
    INTERN(ATTR_MAX_LEN, "max_value_len");
    INTERN(ATTR_RESOURCE, "_resource");
    INTERN(ATTR_STATUS, "_status");
    INTERN(ATTR_STATUS_CODE, "_status_code");
    INTERN(ATTR_START, "_start_time");
    INTERN(ATTR_END, "_end_time");
    INTERN(ATTR_CONTEXT, "_context");
    INTERN(ATTR_TRACE_ID, "trace_id");
    INTERN(ATTR_SPAN_ID, "span_id");
    INTERN(ATTR_SET_ATTRIBUTE, "set_attribute");
    INTERN(PARENT_CONTEXT, "parent_context");
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HandoffType);
    Py_INCREF(&SessionCopierType);
    if (PyModule_AddObject(m, "Handoff", (PyObject *)&HandoffType) < 0
        || PyModule_AddObject(m, "SessionCopier", (PyObject *)&SessionCopierType) < 0 || PyModule_AddIntConstant(m, "HANDED", HANDED) < 0
        || PyModule_AddIntConstant(m, "NEW_RESOURCE", NEW_RESOURCE) < 0
        || PyModule_AddIntConstant(m, "UNSUPPORTED", UNSUPPORTED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

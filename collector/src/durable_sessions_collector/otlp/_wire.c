/*
 * durable_sessions_collector.otlp._wire: a binary ExportTraceServiceRequest read straight
 * from its bytes into the receivers' span parts.
 *
 * The reference is decode.py: parse_protobuf (protobuf's upb parser), then span_parts with
 * mapped_attributes_of. Walking the parsed message from Python costs a wrapper object per
 * field read, several times the parse itself; Decoder.span_parts reads the wire format
 * once and builds only what the mapping reads: per span (name, attributes, resource,
 * status_error, start_time_unix_nano, trace_id hex, span_id hex, end_time_unix_nano),
 * attributes and resource holding only the mapped names (MAPPED_KEYS, MAPPED_PREFIXES),
 * each value typed as value_of types it.
 *
 * It accepts a strict subset of what upb accepts and returns None for everything else,
 * so that the reference path decides (and words the error or the rejection):
 *
 * - any field this file does not list, a field of the wrong wire type, groups;
 * - a singular field given twice (protobuf merges messages given twice), an AnyValue
 *   with more than one field;
 * - malformed varints, a tag or length in more than 5 bytes, lengths past the end, text
 *   that is not UTF-8 (upb rejects the whole request for it, in every string field:
 *   those not built are checked too);
 * - a status code outside int32, nesting deeper than MAX_DEPTH;
 * - a span whose trace or span id would be rejected (wrong length, all zeros).
 *
 * collector/tests/otlp/test_wire_native.py holds it to the reference over generated
 * requests and mutated bytes: the same parts, or None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DECLINE 1 /* a return code: not this decoder's to read (-1: a Python error is set) */
#define MAX_DEPTH 32

enum { VARINT = 0, FIXED64 = 1, LENGTH = 2, FIXED32 = 5 };

typedef struct {
    const unsigned char *p, *end;
} Reader;

typedef struct {
    const char *text;
    Py_ssize_t size;
} Name;

typedef struct {
    PyObject_HEAD
    PyObject *names;    /* tuple of str: the attributes read by name */
    PyObject *prefixes; /* tuple of str: the prefixes whose attributes are all read */
    Name *name_texts;   /* their UTF-8, owned by the str objects above */
    Name *prefix_texts;
} Decoder;

/* --- the wire format --------------------------------------------------------------- */

static int
read_varint(Reader *r, uint64_t *out)
{
    uint64_t value = 0;
    for (int shift = 0; shift <= 63; shift += 7) {
        if (r->p >= r->end)
            return DECLINE;
        unsigned char byte = *r->p++;
        if (shift == 63 && byte > 1)
            return DECLINE;
        value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 0;
        }
    }
    return DECLINE;
}

/* A tag or a length: upb refuses either written in more than 5 bytes (an overlong form
 * padded with zero bits), where it reads any other varint padded up to 10. */
static int
read_short_varint(Reader *r, uint64_t *out)
{
    const unsigned char *start = r->p;
    if (read_varint(r, out) || r->p - start > 5)
        return DECLINE;
    return 0;
}

static int
read_tag(Reader *r, uint32_t *field, int *wire)
{
    uint64_t key;
    if (read_short_varint(r, &key) || key > UINT32_MAX || (key >> 3) == 0)
        return DECLINE;
    *field = (uint32_t)(key >> 3);
    *wire = (int)(key & 7);
    return 0;
}

static int
read_length(Reader *r, Reader *out)
{
    uint64_t size;
    if (read_short_varint(r, &size) || size > (uint64_t)(r->end - r->p))
        return DECLINE;
    out->p = r->p;
    out->end = r->p + size;
    r->p += size;
    return 0;
}

static int
read_fixed(Reader *r, int size, uint64_t *out)
{
    if (r->end - r->p < size)
        return DECLINE;
    uint64_t value = 0;
    for (int i = size - 1; i >= 0; i--)
        value = (value << 8) | r->p[i];
    r->p += size;
    *out = value;
    return 0;
}

/* The value of a field of wire type ``wire``, skipped. */
static int
skip(Reader *r, int wire)
{
    uint64_t ignored;
    Reader inner;
    switch (wire) {
    case VARINT:
        return read_varint(r, &ignored);
    case FIXED64:
        return read_fixed(r, 8, &ignored);
    case FIXED32:
        return read_fixed(r, 4, &ignored);
    case LENGTH:
        return read_length(r, &inner);
    default:
        return DECLINE;
    }
}

/* Whether s[0:size] is UTF-8 as upb and Python's strict decoder define it (no overlong
 * forms, no surrogates, nothing past U+10FFFF). */
static int
utf8_valid(const unsigned char *s, const unsigned char *end)
{
    while (s < end) {
        unsigned char c = *s;
        if (c < 0x80) {
            s++;
            continue;
        }
        Py_ssize_t left = end - s;
        if (c >= 0xC2 && c <= 0xDF) {
            if (left < 2 || (s[1] & 0xC0) != 0x80)
                return 0;
            s += 2;
        }
        else if (c >= 0xE0 && c <= 0xEF) {
            if (left < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80)
                return 0;
            if ((c == 0xE0 && s[1] < 0xA0) || (c == 0xED && s[1] > 0x9F))
                return 0;
            s += 3;
        }
        else if (c >= 0xF0 && c <= 0xF4) {
            if (left < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80)
                return 0;
            if ((c == 0xF0 && s[1] < 0x90) || (c == 0xF4 && s[1] > 0x8F))
                return 0;
            s += 4;
        }
        else
            return 0;
    }
    return 1;
}

/* A string field: read, and checked to be UTF-8. */
static int
read_text(Reader *r, int wire, Reader *out)
{
    if (wire != LENGTH || read_length(r, out))
        return DECLINE;
    return utf8_valid(out->p, out->end) ? 0 : DECLINE;
}

/* A singular field's second appearance declines: protobuf would merge or replace. */
static int
first_time(uint32_t *seen, uint32_t field)
{
    uint32_t bit = 1u << (field & 31);
    if (*seen & bit)
        return 0;
    *seen |= bit;
    return 1;
}

/* --- Python values ------------------------------------------------------------------ */

static PyObject *
text_object(Reader text)
{
    return PyUnicode_DecodeUTF8((const char *)text.p, text.end - text.p, "strict");
}

static PyObject *
hex_object(Reader bytes)
{
    static const char digits[] = "0123456789abcdef";
    Py_ssize_t size = bytes.end - bytes.p;
    PyObject *hex = PyUnicode_New(2 * size, 127);
    if (hex == NULL)
        return NULL;
    Py_UCS1 *out = PyUnicode_1BYTE_DATA(hex);
    for (Py_ssize_t i = 0; i < size; i++) {
        out[2 * i] = digits[bytes.p[i] >> 4];
        out[2 * i + 1] = digits[bytes.p[i] & 15];
    }
    return hex;
}

/* The mapping's name for an attribute key (a new reference), or NULL when the mapping
 * does not read it (no error set). */
static PyObject *
mapped_name(Decoder *self, Reader key)
{
    Py_ssize_t size = key.end - key.p;
    Py_ssize_t count = PyTuple_GET_SIZE(self->prefixes);
    for (Py_ssize_t i = 0; i < count; i++) {
        Name prefix = self->prefix_texts[i];
        if (size >= prefix.size && memcmp(key.p, prefix.text, prefix.size) == 0)
            return text_object(key);
    }
    count = PyTuple_GET_SIZE(self->names);
    for (Py_ssize_t i = 0; i < count; i++) {
        Name name = self->name_texts[i];
        if (size == name.size && memcmp(key.p, name.text, size) == 0)
            return Py_NewRef(PyTuple_GET_ITEM(self->names, i));
    }
    return NULL;
}

/* --- the messages --------------------------------------------------------------------
 * Each reads one message from ``r``. Where ``out`` (or ``into``) is NULL the message is
 * only checked: no Python object is made for it. */

static int any_value(Decoder *self, Reader r, int depth, PyObject **out);

/* A KeyValue, set in ``into``: every key (``all_keys``, a kvlist_value) or the mapped ones. */
static int
key_value(Decoder *self, Reader r, int depth, PyObject *into, int all_keys)
{
    Reader key = {r.p, r.p}, value = {r.p, r.p};
    uint32_t seen = 0, field;
    int wire;
    if (depth > MAX_DEPTH)
        return DECLINE;
    while (r.p < r.end) {
        if (read_tag(&r, &field, &wire) || !first_time(&seen, field))
            return DECLINE;
        if (field == 1) {
            if (read_text(&r, wire, &key))
                return DECLINE;
        }
        else if (field == 2) {
            if (wire != LENGTH || read_length(&r, &value))
                return DECLINE;
        }
        else
            return DECLINE;
    }
    PyObject *name = NULL;
    if (into != NULL) {
        name = all_keys ? text_object(key) : mapped_name(self, key);
        if (name == NULL && PyErr_Occurred())
            return -1;
    }
    PyObject *item = NULL;
    int status = any_value(self, value, depth + 1, name != NULL ? &item : NULL);
    if (status == 0 && name != NULL)
        status = PyDict_SetItem(into, name, item);
    Py_XDECREF(name);
    Py_XDECREF(item);
    return status;
}

/* A repeated message field's items: field 1 of ArrayValue and KeyValueList. */
static int
each_value(Reader *r, Reader *item)
{
    uint32_t field;
    int wire;
    if (read_tag(r, &field, &wire) || field != 1 || wire != LENGTH)
        return DECLINE;
    return read_length(r, item);
}

static int
array_value(Decoder *self, Reader r, int depth, PyObject **out)
{
    PyObject *items = out != NULL ? PyList_New(0) : NULL;
    if (out != NULL && items == NULL)
        return -1;
    int status = 0;
    while (status == 0 && r.p < r.end) {
        Reader item;
        PyObject *value = NULL;
        status = each_value(&r, &item);
        if (status == 0)
            status = any_value(self, item, depth + 1, items != NULL ? &value : NULL);
        if (status == 0 && items != NULL) {
            status = PyList_Append(items, value);
            Py_DECREF(value);
        }
    }
    if (status == 0 && items != NULL) {
        *out = PyList_AsTuple(items);
        status = *out == NULL ? -1 : 0;
    }
    Py_XDECREF(items);
    return status;
}

static int
kvlist_value(Decoder *self, Reader r, int depth, PyObject **out)
{
    PyObject *items = out != NULL ? PyDict_New() : NULL;
    if (out != NULL && items == NULL)
        return -1;
    int status = 0;
    while (status == 0 && r.p < r.end) {
        Reader item;
        status = each_value(&r, &item);
        if (status == 0)
            status = key_value(self, item, depth + 1, items, 1);
    }
    if (status == 0 && out != NULL)
        *out = Py_NewRef(items);
    Py_XDECREF(items);
    return status;
}

/* An AnyValue as value_of makes it: str, bool, int, float, tuple, dict, bytes or None. */
static int
any_value(Decoder *self, Reader r, int depth, PyObject **out)
{
    PyObject *value = NULL;
    uint32_t field;
    int wire, status = 0;
    uint64_t number;
    Reader inner;
    if (depth > MAX_DEPTH)
        return DECLINE;
    if (r.p < r.end) {
        if (read_tag(&r, &field, &wire))
            return DECLINE;
        switch (field) {
        case 1:
            status = read_text(&r, wire, &inner);
            if (status == 0 && out != NULL)
                value = text_object(inner);
            break;
        case 2:
        case 3:
            status = wire != VARINT || read_varint(&r, &number);
            if (status == 0 && out != NULL)
                value = field == 2 ? PyBool_FromLong(number != 0) : PyLong_FromLongLong((long long)number);
            break;
        case 4:
            status = wire != FIXED64 || read_fixed(&r, 8, &number);
            if (status == 0 && out != NULL) {
                double real;
                memcpy(&real, &number, sizeof real);
                value = PyFloat_FromDouble(real);
            }
            break;
        case 5:
        case 6:
            status = wire != LENGTH || read_length(&r, &inner);
            if (status == 0)
                status = (field == 5 ? array_value : kvlist_value)(self, inner, depth + 1, out != NULL ? &value : NULL);
            break;
        case 7:
            status = wire != LENGTH || read_length(&r, &inner);
            if (status == 0 && out != NULL)
                value = PyBytes_FromStringAndSize((const char *)inner.p, inner.end - inner.p);
            break;
        default:
            return DECLINE;
        }
        if (status != 0)
            return status;
        if (out != NULL && value == NULL)
            return -1;
        if (r.p < r.end) { /* a second field: protobuf's oneof keeps the last, or merges */
            Py_XDECREF(value);
            return DECLINE;
        }
    }
    if (out != NULL)
        *out = value != NULL ? value : Py_NewRef(Py_None);
    return 0;
}

/* Only checks the fields of a message made of strings, repeated strings, KeyValues
 * (``attributes_field``), scalars and skipped bytes: InstrumentationScope, Span.Event,
 * Span.Link, EntityRef, Status. ``kinds`` gives each field number's wire type, and
 * marks text ('t'), repeated text ('r'), bytes ('b'), KeyValues ('a'). */
static int
check_message(Decoder *self, Reader r, int depth, const char *kinds)
{
    uint32_t seen = 0, field;
    int wire;
    size_t count = strlen(kinds);
    if (depth > MAX_DEPTH)
        return DECLINE;
    while (r.p < r.end) {
        if (read_tag(&r, &field, &wire) || field >= count || kinds[field] == '-')
            return DECLINE;
        char kind = kinds[field];
        if (kind != 'r' && kind != 'a' && !first_time(&seen, field))
            return DECLINE;
        Reader inner;
        int status;
        switch (kind) {
        case 't':
        case 'r':
            status = read_text(&r, wire, &inner);
            break;
        case 'a':
            status = wire != LENGTH || read_length(&r, &inner);
            if (status == 0)
                status = key_value(self, inner, depth + 1, NULL, 0);
            break;
        case 'b':
            status = wire != LENGTH || skip(&r, wire);
            break;
        case 'v':
            status = wire != VARINT || skip(&r, wire);
            break;
        case '8':
            status = wire != FIXED64 || skip(&r, wire);
            break;
        case '4':
            status = wire != FIXED32 || skip(&r, wire);
            break;
        default:
            return DECLINE;
        }
        if (status != 0)
            return status;
    }
    return 0;
}

/* Field kinds by number (index 0 unused), for check_message. */
static const char SCOPE_FIELDS[] = "-ttav";    /* name, version, attributes, dropped */
static const char EVENT_FIELDS[] = "-8tav";    /* time, name, attributes, dropped */
static const char LINK_FIELDS[] = "-bbtav4";   /* ids, trace_state, attributes, dropped, flags */
static const char ENTITY_FIELDS[] = "-ttrr";   /* schema_url, type, id_keys, description_keys */

/* Status: its message is checked, its code read. */
static int
status_is_error(Reader r, int *error)
{
    uint32_t seen = 0, field;
    int wire;
    Reader message;
    uint64_t code = 0;
    while (r.p < r.end) {
        if (read_tag(&r, &field, &wire) || !first_time(&seen, field))
            return DECLINE;
        if (field == 2) {
            if (read_text(&r, wire, &message))
                return DECLINE;
        }
        else if (field == 3) {
            if (wire != VARINT || read_varint(&r, &code) || code > INT32_MAX)
                return DECLINE;
        }
        else
            return DECLINE;
    }
    *error = code == 2; /* STATUS_CODE_ERROR */
    return 0;
}

static int
usable_id(Reader id, Py_ssize_t size)
{
    if (id.end - id.p != size)
        return 0;
    for (const unsigned char *p = id.p; p < id.end; p++)
        if (*p)
            return 1;
    return 0; /* all zeros: invalid in OTLP */
}

static PyObject *
span_tuple(Reader name, PyObject *attributes, PyObject *resource, int error, uint64_t start,
           Reader trace_id, Reader span_id, uint64_t end)
{
    PyObject *parts = PyTuple_New(8);
    if (parts == NULL)
        return NULL;
    PyTuple_SET_ITEM(parts, 0, text_object(name));
    PyTuple_SET_ITEM(parts, 1, Py_NewRef(attributes));
    PyTuple_SET_ITEM(parts, 2, Py_NewRef(resource));
    PyTuple_SET_ITEM(parts, 3, PyBool_FromLong(error));
    PyTuple_SET_ITEM(parts, 4, PyLong_FromUnsignedLongLong(start));
    PyTuple_SET_ITEM(parts, 5, hex_object(trace_id));
    PyTuple_SET_ITEM(parts, 6, hex_object(span_id));
    PyTuple_SET_ITEM(parts, 7, PyLong_FromUnsignedLongLong(end));
    for (int i = 0; i < 8; i++)
        if (PyTuple_GET_ITEM(parts, i) == NULL) {
            Py_DECREF(parts);
            return NULL;
        }
    return parts;
}

/* A Span, appended to ``spans`` as its parts. */
static int
span(Decoder *self, Reader r, int depth, PyObject *resource, PyObject *spans)
{
    Reader trace_id = {r.p, r.p}, span_id = trace_id, name = trace_id, inner;
    uint64_t start = 0, end = 0;
    uint32_t seen = 0, field;
    int wire, error = 0, status = 0;
    PyObject *attributes = PyDict_New();
    if (attributes == NULL)
        return -1;
    while (status == 0 && r.p < r.end) {
        if (read_tag(&r, &field, &wire) || field > 16) {
            status = DECLINE;
            break;
        }
        if (field != 9 && field != 11 && field != 13 && !first_time(&seen, field)) {
            status = DECLINE;
            break;
        }
        switch (field) {
        case 1:
        case 2:
            status = wire != LENGTH || read_length(&r, field == 1 ? &trace_id : &span_id);
            break;
        case 3:
            status = read_text(&r, wire, &inner);
            break;
        case 4:
            status = wire != LENGTH || skip(&r, wire);
            break;
        case 5:
            status = read_text(&r, wire, &name);
            break;
        case 6:
        case 10:
        case 12:
        case 14:
            status = wire != VARINT || skip(&r, wire);
            break;
        case 7:
            status = wire != FIXED64 || read_fixed(&r, 8, &start);
            break;
        case 8:
            status = wire != FIXED64 || read_fixed(&r, 8, &end);
            break;
        case 16:
            status = wire != FIXED32 || skip(&r, wire);
            break;
        default: /* 9 attributes, 11 events, 13 links, 15 status: messages */
            status = wire != LENGTH || read_length(&r, &inner);
            if (status != 0)
                break;
            if (field == 9)
                status = key_value(self, inner, depth + 1, attributes, 0);
            else if (field == 11 || field == 13)
                status = check_message(self, inner, depth + 1, field == 11 ? EVENT_FIELDS : LINK_FIELDS);
            else
                status = status_is_error(inner, &error);
        }
    }
    if (status == 0 && !(usable_id(trace_id, 16) && usable_id(span_id, 8)))
        status = DECLINE; /* rejected by the reference path, which words why */
    if (status == 0) {
        PyObject *parts = span_tuple(name, attributes, resource, error, start, trace_id, span_id, end);
        status = parts == NULL ? -1 : PyList_Append(spans, parts);
        Py_XDECREF(parts);
    }
    Py_DECREF(attributes);
    return status;
}

static int
scope_spans(Decoder *self, Reader r, int depth, PyObject *resource, PyObject *spans)
{
    uint32_t seen = 0, field;
    int wire, status = 0;
    Reader inner;
    while (status == 0 && r.p < r.end) {
        if (read_tag(&r, &field, &wire) || (field != 2 && !first_time(&seen, field)))
            return DECLINE;
        if (field == 1 || field == 2) {
            status = wire != LENGTH || read_length(&r, &inner);
            if (status == 0)
                status = field == 1 ? check_message(self, inner, depth + 1, SCOPE_FIELDS)
                                    : span(self, inner, depth + 1, resource, spans);
        }
        else if (field == 3)
            status = read_text(&r, wire, &inner);
        else
            return DECLINE;
    }
    return status;
}

/* A Resource: its mapped attributes set in ``into``, the rest checked. */
static int
resource_of(Decoder *self, Reader r, int depth, PyObject *into)
{
    uint32_t seen = 0, field;
    int wire, status = 0;
    Reader inner;
    while (status == 0 && r.p < r.end) {
        if (read_tag(&r, &field, &wire))
            return DECLINE;
        if (field == 1 || field == 3) {
            status = wire != LENGTH || read_length(&r, &inner);
            if (status == 0)
                status = field == 1 ? key_value(self, inner, depth + 1, into, 0)
                                    : check_message(self, inner, depth + 1, ENTITY_FIELDS);
        }
        else if (field == 2 && first_time(&seen, field))
            status = wire != VARINT || skip(&r, wire);
        else
            return DECLINE;
    }
    return status;
}

/* ResourceSpans: the resource's dict is made first and shared by its spans, wherever
 * the resource field comes. */
static int
resource_spans(Decoder *self, Reader r, PyObject *spans)
{
    uint32_t seen = 0, field;
    int wire, status = 0;
    Reader inner;
    PyObject *resource = PyDict_New();
    if (resource == NULL)
        return -1;
    while (status == 0 && r.p < r.end) {
        if (read_tag(&r, &field, &wire) || (field != 2 && !first_time(&seen, field))) {
            status = DECLINE;
            break;
        }
        if (field == 1 || field == 2) {
            status = wire != LENGTH || read_length(&r, &inner);
            if (status == 0)
                status = field == 1 ? resource_of(self, inner, 2, resource)
                                    : scope_spans(self, inner, 2, resource, spans);
        }
        else if (field == 3)
            status = read_text(&r, wire, &inner);
        else
            status = DECLINE;
    }
    Py_DECREF(resource);
    return status;
}

/* --- the Decoder type ---------------------------------------------------------------- */

PyDoc_STRVAR(span_parts_doc,
"span_parts(body, /)\n--\n\n"
"The parts of every span of a binary ExportTraceServiceRequest, as decode.span_parts\n"
"yields them with mapped_attributes_of, or None when the request is not one this\n"
"decoder reads (see the module's source): the reference path then decides.");

static PyObject *
Decoder_span_parts(Decoder *self, PyObject *body)
{
    Py_buffer view;
    if (self->names == NULL) { /* made by Decoder.__new__ without __init__ */
        PyErr_SetString(PyExc_RuntimeError, "Decoder is not initialised");
        return NULL;
    }
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Reader r = {view.buf, (const unsigned char *)view.buf + view.len}, inner;
    PyObject *spans = PyList_New(0);
    int status = spans == NULL ? -1 : 0;
    while (status == 0 && r.p < r.end) {
        uint32_t field;
        int wire;
        status = read_tag(&r, &field, &wire) || field != 1 || wire != LENGTH || read_length(&r, &inner);
        if (status == 0)
            status = resource_spans(self, inner, spans);
    }
    PyBuffer_Release(&view);
    if (status == 0)
        return spans;
    Py_XDECREF(spans);
    return status < 0 ? NULL : Py_NewRef(Py_None);
}

/* The UTF-8 of each str of ``texts`` (a tuple); they live as long as the tuple does. */
static Name *
texts_of(PyObject *texts)
{
    Py_ssize_t count = PyTuple_GET_SIZE(texts);
    Name *out = PyMem_Calloc(count ? count : 1, sizeof(Name));
    if (out == NULL)
        return (Name *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *text = PyTuple_GET_ITEM(texts, i);
        if (!PyUnicode_Check(text)) {
            PyMem_Free(out);
            PyErr_Format(PyExc_TypeError, "attribute names must be str, not %.100s", Py_TYPE(text)->tp_name);
            return NULL;
        }
        out[i].text = PyUnicode_AsUTF8AndSize(text, &out[i].size);
        if (out[i].text == NULL) {
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

static int
Decoder_init(Decoder *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"names", "prefixes", NULL};
    PyObject *names, *prefixes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Decoder", keywords, &names, &prefixes))
        return -1;
    names = PySequence_Tuple(names);
    prefixes = names ? PySequence_Tuple(prefixes) : NULL;
    Name *name_texts = prefixes ? texts_of(names) : NULL;
    Name *prefix_texts = name_texts ? texts_of(prefixes) : NULL;
    if (prefix_texts == NULL) {
        PyMem_Free(name_texts);
        Py_XDECREF(names);
        Py_XDECREF(prefixes);
        return -1;
    }
    PyMem_Free(self->name_texts);
    PyMem_Free(self->prefix_texts);
    Py_XSETREF(self->names, names);
    Py_XSETREF(self->prefixes, prefixes);
    self->name_texts = name_texts;
    self->prefix_texts = prefix_texts;
    return 0;
}

static void
Decoder_dealloc(Decoder *self)
{
    Py_XDECREF(self->names);
    Py_XDECREF(self->prefixes);
    PyMem_Free(self->name_texts);
    PyMem_Free(self->prefix_texts);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Decoder_methods[] = {
    {"span_parts", (PyCFunction)Decoder_span_parts, METH_O, span_parts_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Decoder_doc,
"Decoder(names, prefixes)\n--\n\n"
"Reads binary OTLP trace requests into span parts, keeping the attributes named in\n"
"``names`` and those starting with one of ``prefixes``.");

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "durable_sessions_collector.otlp._wire.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_dealloc = (destructor)Decoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Decoder_doc,
    .tp_methods = Decoder_methods,
    .tp_init = (initproc)Decoder_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "durable_sessions_collector.otlp._wire",
    .m_doc = "Binary OTLP trace requests read into the receivers' span parts (decode.py is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__wire(void)
{
    if (PyType_Ready(&DecoderType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&wire_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

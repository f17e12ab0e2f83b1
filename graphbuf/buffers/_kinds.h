/* Element kinds of a buffer-protocol view, shared by graphbuf/buffers/_native.c and _staged.c. */
#ifndef GRAPHBUF_KINDS_H
#define GRAPHBUF_KINDS_H

#include <Python.h>
#include <stdint.h>

enum { K_NONE = 0, K_SIGNED, K_UNSIGNED, K_BOOL, K_FLOAT };

/* The kind of a view's single-element format; K_NONE for anything else (structs, a byte order that is not
 * the host's). */
static inline int kind_of(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    const uint16_t one = 1;
    const char native_order = *(const uint8_t *)&one ? '<' : '>'; /* an explicit order must be the host's */
    if (*f == '@' || *f == '=' || *f == native_order) f++;
    else if (*f == '<' || *f == '>' || *f == '!') return K_NONE;
    if (f[0] == '\0' || f[1] != '\0') return K_NONE;
    switch (f[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': return K_SIGNED;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': return K_UNSIGNED;
    case '?': return K_BOOL;
    case 'e': case 'f': case 'd': return K_FLOAT;
    default: return K_NONE;
    }
}

#endif

;;;; corpus.lisp -- the conformance corpus: request octets and the verdict
;;;; Gallop owes them, written from RFC 9112 / RFC 9110 and the policy of
;;;; issue 13 (every front end gives one reading of every request).
;;;;
;;;; Each case is a list
;;;;
;;;;   (NAME SECTION SEND &key SEEN THEN)
;;;;
;;;;   NAME     a unique string
;;;;   SECTION  the RFC section the case exercises ("9112 7.1" is RFC 9112,
;;;;            section 7.1; "6585 5" is RFC 6585's 431)
;;;;   SEND     the exact octets the client writes, as one segment or a list of
;;;;            segments (see below).  They may hold several pipelined requests.
;;;;            The client then half-closes (shutdown SHUT_WR) and reads every
;;;;            answer until the server closes.
;;;;   SEEN     the requests the app must see, in order, each
;;;;            (METHOD TARGET HEADER-COUNT BODY): the method token and the
;;;;            request-target exactly as sent, the number of distinct header
;;;;            field names of the head (case-insensitive; trailer fields are
;;;;            not counted), and the body octets after decoding.  Each one is
;;;;            answered 200.
;;;;   THEN     what follows the answers to SEEN:
;;;;              NIL     nothing: the octets ended at a request boundary (or
;;;;                      the connection had to close after the last request
;;;;                      served, as after HTTP/1.0 without keep-alive)
;;;;              STATUS  Gallop answers STATUS (400 413 414 431 501 505) before
;;;;                      any app has seen a complete request, and closes
;;;;              :CLOSE  the octets end inside a request (the client cut it
;;;;                      and half-closed): no answer, the server closes.  RFC
;;;;                      9112 section 8 allows an error answer here; Gallop
;;;;                      answers nothing, as it does for any head cut by end
;;;;                      of file (doc/conformance.md says why), but for one
;;;;                      whose request line is whole and refused (STATUS).
;;;;
;;;; Segments are strings with these escapes, so that every CR and LF in a
;;;; case is visible:
;;;;   |     CR LF                  ^r  CR        ^n  LF       ^t  HTAB
;;;;   ^0    NUL                    ^xHH  the octet HH (hex)
;;;;   ^|    a literal |            ^^  a literal ^
;;;; every other character is its own (Latin-1) octet.  A segment may also be
;;;; (:repeat SEGMENT N), SEGMENT N times, or (:numbered CONTROL N): CONTROL (a
;;;; FORMAT string taking the index 1..N) N times, or (:numbered (SEGMENT ...) N)
;;;; where the strings among the SEGMENTs are such FORMAT strings.  METHOD,
;;;; TARGET and BODY in SEEN use the same notation.
;;;;
;;;; Default limits apply (request line 65536 bytes, head 1 MiB, body 64 MiB).
;;;; Each error case has exactly one fault unless the spec says how two
;;;; combine (Transfer-Encoding with Content-Length): the precedence of two
;;;; refusals is not part of the policy, so no case pins it.

(in-package #:gallop-tests)

(defparameter *corpus*
  '(
    ;;; -------------------------------------------------------------------
    ;;; Valid requests: request-target forms, versions, methods (any token)
    ;;; -------------------------------------------------------------------
    ("get-origin-form" "9112 3.2.1"
     "GET / HTTP/1.1|Host: x||"
     :seen (("GET" "/" 1 "")))
    ("get-path-and-query" "9112 3.2.1"
     "GET /a/b?c=d&e=f;g HTTP/1.1|Host: x||"
     :seen (("GET" "/a/b?c=d&e=f;g" 1 "")))
    ("get-percent-encoded-target" "9112 3.2"
     "GET /a%20b/%C3%a9?x=%2F HTTP/1.1|Host: x||"
     :seen (("GET" "/a%20b/%C3%a9?x=%2F" 1 "")))
    ("get-target-visible-ascii" "9112 3.2"
     "GET /a\"b<c>{d}`e HTTP/1.1|Host: x||"
     :seen (("GET" "/a\"b<c>{d}`e" 1 "")))
    ("get-absolute-form" "9112 3.2.2"
     "GET http://x/abs?q=1 HTTP/1.1|Host: x||"
     :seen (("GET" "http://x/abs?q=1" 1 "")))
    ("options-asterisk-form" "9112 3.2.4"
     "OPTIONS * HTTP/1.1|Host: x||"
     :seen (("OPTIONS" "*" 1 "")))
    ("connect-authority-form" "9112 3.2.3"
     "CONNECT x:443 HTTP/1.1|Host: x:443||"
     :seen (("CONNECT" "x:443" 1 "")))
    ("head-request" "9110 9.3.2"
     "HEAD /h HTTP/1.1|Host: x||"
     :seen (("HEAD" "/h" 1 "")))
    ("http10-without-host" "9112 3.2"
     "GET /old HTTP/1.0||"
     :seen (("GET" "/old" 0 "")))
    ("http10-with-host" "9112 2.3"
     "GET / HTTP/1.0|Host: x||"
     :seen (("GET" "/" 1 "")))
    ("method-lower-case-get" "9110 9.1"
     "get / HTTP/1.1|Host: x||"
     :seen (("get" "/" 1 "")))
    ("method-mixed-case" "9110 9.1"
     "GeT / HTTP/1.1|Host: x||"
     :seen (("GeT" "/" 1 "")))
    ("method-m-search" "9110 9.1"
     "M-SEARCH * HTTP/1.1|Host: 239.255.255.250:1900|MAN: \"ssdp:discover\"|MX: 1|ST: ssdp:all||"
     :seen (("M-SEARCH" "*" 4 "")))
    ("method-query-with-body" "9110 9.1"
     "QUERY /q HTTP/1.1|Host: x|Content-Type: application/sql|Content-Length: 8||SELECT 1"
     :seen (("QUERY" "/q" 3 "SELECT 1")))
    ("method-brew" "9110 9.1"
     "BREW /pot HTTP/1.1|Host: x||"
     :seen (("BREW" "/pot" 1 "")))
    ("method-propfind" "9110 9.1"
     "PROPFIND /dav HTTP/1.1|Host: x|Depth: 1|Content-Length: 0||"
     :seen (("PROPFIND" "/dav" 3 "")))
    ("method-one-character" "9110 5.6.2"
     "X / HTTP/1.1|Host: x||"
     :seen (("X" "/" 1 "")))
    ("method-every-tchar" "9110 5.6.2"
     "!#$%&'*+-.^^_`^|~09azAZ / HTTP/1.1|Host: x||"
     :seen (("!#$%&'*+-.^^_`^|~09azAZ" "/" 1 "")))
    ("method-trace" "9110 9.3.8"
     "TRACE /t HTTP/1.1|Host: x||"
     :seen (("TRACE" "/t" 1 "")))
    ("method-patch-with-body" "9110 9.1"
     "PATCH /r HTTP/1.1|Host: x|Content-Length: 3||abc"
     :seen (("PATCH" "/r" 2 "abc")))
    ("method-delete" "9110 9.3.5"
     "DELETE /r HTTP/1.1|Host: x||"
     :seen (("DELETE" "/r" 1 "")))

    ;;; -------------------------------------------------------------------
    ;;; Valid heads: empty lines before the request line, field syntax
    ;;; -------------------------------------------------------------------
    ("leading-empty-line" "9112 2.2"
     "|GET / HTTP/1.1|Host: x||"
     :seen (("GET" "/" 1 "")))
    ("leading-two-empty-lines" "9112 2.2"
     "||GET / HTTP/1.1|Host: x||"
     :seen (("GET" "/" 1 "")))
    ("field-no-space-after-colon" "9112 5.1"
     "GET / HTTP/1.1|Host:x||"
     :seen (("GET" "/" 1 "")))
    ("field-empty-value" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-Empty:||"
     :seen (("GET" "/" 2 "")))
    ("field-value-only-whitespace" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-Blank: ^t ^t||"
     :seen (("GET" "/" 2 "")))
    ("field-value-inner-tab" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: a^tb||"
     :seen (("GET" "/" 2 "")))
    ("field-value-obs-text" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: caf^xe9 ^xff^x80||"
     :seen (("GET" "/" 2 "")))
    ("field-value-trailing-whitespace" "9112 5.1"
     "GET / HTTP/1.1|Host: x|X-A: v ^t ||"
     :seen (("GET" "/" 2 "")))
    ("field-value-with-colons" "9112 5.1"
     "GET / HTTP/1.1|Host: x|X-A: a:b: c||"
     :seen (("GET" "/" 2 "")))
    ("field-name-every-tchar" "9110 5.1"
     "GET / HTTP/1.1|Host: x|!#$%&'*+-.^^_`^|~09azAZ: v||"
     :seen (("GET" "/" 2 "")))
    ("field-repeated-name" "9110 5.3"
     "GET / HTTP/1.1|Host: x|X-A: 1|X-A: 2|x-a: 3||"
     :seen (("GET" "/" 2 "")))
    ("field-name-case-host" "9110 5.1"
     "GET / HTTP/1.1|hOST: x||"
     :seen (("GET" "/" 1 "")))
    ("field-underscore-name" "9110 5.1"
     "GET / HTTP/1.1|Host: x|X_Under: v||"
     :seen (("GET" "/" 2 "")))
    ("field-hundred-fields" "9112 5"
     ("GET / HTTP/1.1|Host: x|" (:numbered "X-F~D: v|" 100) "|")
     :seen (("GET" "/" 101 "")))
    ("host-empty-value" "9110 7.2"
     "GET / HTTP/1.1|Host:||"
     :seen (("GET" "/" 1 "")))
    ("host-with-port" "9110 7.2"
     "GET / HTTP/1.1|Host: x:8080||"
     :seen (("GET" "/" 1 "")))
    ("host-ipv6-literal-with-port" "9110 7.2"
     "GET / HTTP/1.1|Host: [::1]:8080||"
     :seen (("GET" "/" 1 "")))
    ("host-ipv4-and-pct-encoded" "9110 7.2"
     "GET / HTTP/1.1|Host: 127.0.0.1|X-B: 1||GET / HTTP/1.1|Host: ex%41mple.com||"
     :seen (("GET" "/" 2 "") ("GET" "/" 1 "")))
    ("connection-close" "9112 9.6"
     "GET / HTTP/1.1|Host: x|Connection: close||"
     :seen (("GET" "/" 2 "")))
    ("long-target-under-limit" "9112 3"
     ("GET /" (:repeat "a" 60000) " HTTP/1.1|Host: x||")
     :seen (("GET" ("/" (:repeat "a" 60000)) 1 "")))
    ("large-head-under-limit" "9112 5"
     ("GET / HTTP/1.1|Host: x|" (:numbered ("X-Big~D: " (:repeat "a" 60000) "|") 10) "|")
     :seen (("GET" "/" 11 "")))

    ;;; -------------------------------------------------------------------
    ;;; Content-Length bodies
    ;;; -------------------------------------------------------------------
    ("post-content-length" "9112 6.2"
     "POST /p HTTP/1.1|Host: x|Content-Length: 5||hello"
     :seen (("POST" "/p" 2 "hello")))
    ("post-content-length-zero" "9112 6.2"
     "POST /p HTTP/1.1|Host: x|Content-Length: 0||"
     :seen (("POST" "/p" 2 "")))
    ("post-without-framing-has-no-body" "9112 6.3"
     "POST /p HTTP/1.1|Host: x||"
     :seen (("POST" "/p" 1 "")))
    ("put-binary-body" "9112 6.2"
     "PUT /b HTTP/1.1|Host: x|Content-Length: 7||a^r^n^0^xff^x80z"
     :seen (("PUT" "/b" 2 "a^r^n^0^xff^x80z")))
    ("get-with-body" "9110 9.3.1"
     "GET /g HTTP/1.1|Host: x|Content-Length: 3||abc"
     :seen (("GET" "/g" 2 "abc")))
    ("http10-post-content-length" "9112 6.2"
     "POST /p HTTP/1.0|Content-Length: 5||hello"
     :seen (("POST" "/p" 1 "hello")))
    ("content-length-ows" "9112 5.1"
     "POST /p HTTP/1.1|Host: x|Content-Length:   5  ||hello"
     :seen (("POST" "/p" 2 "hello")))
    ("content-length-tab-ows" "9112 5.1"
     "POST /p HTTP/1.1|Host: x|Content-Length:^t5^t||hello"
     :seen (("POST" "/p" 2 "hello")))
    ("content-length-repeated-same-value" "9110 8.6"
     "POST /p HTTP/1.1|Host: x|Content-Length: 5|Content-Length: 5||hello"
     :seen (("POST" "/p" 2 "hello")))
    ("content-length-18-digits" "9110 8.6"
     "POST /p HTTP/1.1|Host: x|Content-Length: 000000000000000005||hello"
     :seen (("POST" "/p" 2 "hello")))
    ("content-length-name-case" "9110 5.1"
     "POST /p HTTP/1.1|Host: x|cONTENT-lENGTH: 5||hello"
     :seen (("POST" "/p" 2 "hello")))
    ("body-looks-like-a-request" "9112 6.3"
     "POST /p HTTP/1.1|Host: x|Content-Length: 28||GET /x HTTP/1.1|Host: x||"
     :seen (("POST" "/p" 2 "GET /x HTTP/1.1|Host: x||")))
    ("body-looks-like-chunks" "9112 6.3"
     "POST /p HTTP/1.1|Host: x|Content-Length: 15||5|hello|0||"
     :seen (("POST" "/p" 2 "5|hello|0||")))
    ("expect-100-continue" "9110 10.1.1"
     "POST /p HTTP/1.1|Host: x|Expect: 100-continue|Content-Length: 5||hello"
     :seen (("POST" "/p" 3 "hello")))

    ;;; -------------------------------------------------------------------
    ;;; Chunked bodies (RFC 9112 7.1)
    ;;; -------------------------------------------------------------------
    ("chunked-one-chunk" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-two-chunks" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|6| world|0||"
     :seen (("POST" "/c" 2 "hello world")))
    ("chunked-empty-body" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||0||"
     :seen (("POST" "/c" 2 "")))
    ("chunked-size-upper-hex" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||A|0123456789|0||"
     :seen (("POST" "/c" 2 "0123456789")))
    ("chunked-size-lower-hex" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||1a|abcdefghijklmnopqrstuvwxyz|0||"
     :seen (("POST" "/c" 2 "abcdefghijklmnopqrstuvwxyz")))
    ("chunked-size-leading-zeros" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||005|hello|000||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-size-15-digits" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||000000000000005|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-many-small-chunks" "9112 7.1"
     ("POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||" (:repeat "1|a|" 50) "0||")
     :seen (("POST" "/c" 2 (:repeat "a" 50))))
    ("chunked-data-holds-crlf" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||4|^r^n^r^n|0||"
     :seen (("POST" "/c" 2 "^r^n^r^n")))
    ("chunked-data-looks-like-last-chunk" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|0^r^n^r^n|0||"
     :seen (("POST" "/c" 2 "0^r^n^r^n")))
    ("chunked-ext-token-value" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;name=value|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-no-value" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;flag|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-quoted-value" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=\"b c\"|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-quoted-pair-and-bws" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5 ; a = \"b\\\"c\"|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-quoted-backslash" "9110 5.6.4"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=\"\\\\\"|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-quoted-semicolon" "9110 5.6.4"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=\"x;y=z\"|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-quoted-obs-text" "9110 5.6.4"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=\"caf^xe9\"|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-several" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=1;b;c=\"3\"|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-bws-tabs" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5^t;^ta^t=^t1|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-ext-on-last-chunk" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0;end=1||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-trailer" "9112 7.1.2"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: 1||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-two-trailers" "9112 7.1.2"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: 1|X-U:2||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-trailer-content-length-ignored" "9110 6.5.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|Content-Length: 100||"
     :seen (("POST" "/c" 2 "hello")))
    ("te-chunked-capitalised" "9112 7"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: Chunked||5|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("te-chunked-upper-case" "9112 7"
     "POST /c HTTP/1.1|Host: x|TRANSFER-ENCODING: CHUNKED||5|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("te-chunked-ows" "9112 5.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: ^t chunked ^t||5|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunked-expect-100-continue" "9110 10.1.1"
     "POST /c HTTP/1.1|Host: x|Expect: 100-continue|Transfer-Encoding: chunked||5|hello|0||"
     :seen (("POST" "/c" 3 "hello")))
    ("chunked-in-http10" "9112 6.1"
     "POST /c HTTP/1.0|Transfer-Encoding: chunked||5|hello|0||"
     :seen (("POST" "/c" 1 "hello")))
    ;; Chunked framing in HTTP/1.0: answered, then the connection closes even
    ;; though the client asked for keep-alive; the next request is not read.
    ("chunked-in-http10-then-closes" "9112 6.1"
     "POST /c HTTP/1.0|Connection: keep-alive|Transfer-Encoding: chunked||5|hello|0||GET /2 HTTP/1.0||"
     :seen (("POST" "/c" 2 "hello")))

    ;;; -------------------------------------------------------------------
    ;;; Pipelining and persistence (RFC 9112 9.3)
    ;;; -------------------------------------------------------------------
    ("pipeline-two-gets" "9112 9.3.2"
     "GET /1 HTTP/1.1|Host: x||GET /2 HTTP/1.1|Host: x||"
     :seen (("GET" "/1" 1 "") ("GET" "/2" 1 "")))
    ("pipeline-get-post-get" "9112 9.3.2"
     "GET /1 HTTP/1.1|Host: x||POST /2 HTTP/1.1|Host: x|Content-Length: 5||helloGET /3 HTTP/1.1|Host: x||"
     :seen (("GET" "/1" 1 "") ("POST" "/2" 2 "hello") ("GET" "/3" 1 "")))
    ("pipeline-chunked-then-get" "9112 9.3.2"
     "POST /1 HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: 1||GET /2 HTTP/1.1|Host: x||"
     :seen (("POST" "/1" 2 "hello") ("GET" "/2" 1 "")))
    ("pipeline-empty-line-between" "9112 2.2"
     "GET /1 HTTP/1.1|Host: x|||GET /2 HTTP/1.1|Host: x||"
     :seen (("GET" "/1" 1 "") ("GET" "/2" 1 "")))
    ("pipeline-http10-closes-after-first" "9112 9.3"
     "GET /1 HTTP/1.0||GET /2 HTTP/1.0||"
     :seen (("GET" "/1" 0 "")))
    ("pipeline-http10-keep-alive" "9112 9.3"
     "GET /1 HTTP/1.0|Connection: keep-alive||GET /2 HTTP/1.0||"
     :seen (("GET" "/1" 1 "") ("GET" "/2" 0 "")))
    ("pipeline-connection-close-then-get" "9112 9.6"
     "GET /1 HTTP/1.1|Host: x|Connection: close||GET /2 HTTP/1.1|Host: x||"
     :seen (("GET" "/1" 2 "")))
    ("pipeline-get-then-garbage-head" "9112 3"
     "GET /1 HTTP/1.1|Host: x||HELLO WORLD||"
     :seen (("GET" "/1" 1 "")) :then 400)
    ("pipeline-get-then-get-then-garbage" "9112 3"
     "GET /1 HTTP/1.1|Host: x||GET /2 HTTP/1.1|Host: x||^x16^x03^x01 junk||"
     :seen (("GET" "/1" 1 "") ("GET" "/2" 1 "")) :then 400)
    ("pipeline-get-then-http2" "9112 2.3"
     "GET /1 HTTP/1.1|Host: x||GET /2 HTTP/2.0|Host: x||"
     :seen (("GET" "/1" 1 "")) :then 505)
    ("pipeline-get-then-gzip-coding" "9112 6.1"
     "GET /1 HTTP/1.1|Host: x||POST /2 HTTP/1.1|Host: x|Transfer-Encoding: gzip||"
     :seen (("GET" "/1" 1 "")) :then 501)
    ("pipeline-get-then-bare-lf" "9112 2.2"
     "GET /1 HTTP/1.1|Host: x||^nGET /2 HTTP/1.1|Host: x||"
     :seen (("GET" "/1" 1 "")) :then 400)
    ("pipeline-get-then-unterminated-junk" "9112 8"
     "GET /1 HTTP/1.1|Host: x||^x16^x03^x01^x00^xa5^x01"
     :seen (("GET" "/1" 1 "")) :then :close)
    ("pipeline-get-then-cut-request" "9112 8"
     "GET /1 HTTP/1.1|Host: x||GET /2 HTTP/1.1|Ho"
     :seen (("GET" "/1" 1 "")) :then :close)
    ;; A Content-Length shorter than what follows: the rest is the next
    ;; request, read exactly where the declared body ends.
    ("content-length-short-rest-is-next-request" "9112 6.3"
     "POST /1 HTTP/1.1|Host: x|Content-Length: 2||helloGET /2 HTTP/1.1|Host: x||"
     :seen (("POST" "/1" 2 "he") ("lloGET" "/2" 1 "")))
    ("chunked-extra-last-chunk-is-next-request" "9112 7.1"
     "POST /1 HTTP/1.1|Host: x|Transfer-Encoding: chunked||0||0||"
     :seen (("POST" "/1" 2 "")) :then 400)
    ;; Transfer_Encoding is a valid, unknown field name: no body framing, so
    ;; the chunks are the next request, whose request line "5" is refused.
    ("te-underscore-name-is-not-te" "9112 6.3"
     "POST / HTTP/1.1|Host: x|Transfer_Encoding: chunked||5|hello|0||"
     :seen (("POST" "/" 2 "")) :then 400)

    ;;; -------------------------------------------------------------------
    ;;; Smuggling shapes: Content-Length and Transfer-Encoding
    ;;; -------------------------------------------------------------------
    ("cl-then-te" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Content-Length: 5|Transfer-Encoding: chunked||0||"
     :then 400)
    ("te-then-cl" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked|Content-Length: 5||0||"
     :then 400)
    ("cl-te-lower-case-names" "9112 6.1"
     "POST / HTTP/1.1|Host: x|content-length: 5|transfer-encoding: chunked||0||"
     :then 400)
    ("te-cl-upper-case-names" "9112 6.1"
     "POST / HTTP/1.1|Host: x|TRANSFER-ENCODING: chunked|CONTENT-LENGTH: 5||0||"
     :then 400)
    ("te-with-cl-zero" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked|Content-Length: 0||0||"
     :then 400)
    ("cl-te-http10" "9112 6.1"
     "POST / HTTP/1.0|Content-Length: 5|Transfer-Encoding: chunked||0||"
     :then 400)
    ("cl-te-classic-smuggle" "9112 11.2"
     "POST / HTTP/1.1|Host: x|Content-Length: 6|Transfer-Encoding: chunked||0||GPOST / HTTP/1.1|Host: x||"
     :then 400)
    ("cl-different-values" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 5|Content-Length: 6||hello!"
     :then 400)
    ("cl-list-same-values" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 5, 5||hello"
     :then 400)
    ("cl-list-no-space" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 5,5||hello"
     :then 400)
    ("cl-list-different-values" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 5, 6||hello!"
     :then 400)
    ("cl-plus-sign" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: +5||hello"
     :then 400)
    ("cl-minus-sign" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: -5||hello"
     :then 400)
    ("cl-space-inside" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 1 0||helloworld"
     :then 400)
    ("cl-hex" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 0x5||hello"
     :then 400)
    ("cl-trailing-letter" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 5a||hello"
     :then 400)
    ("cl-decimal-point" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 5.0||hello"
     :then 400)
    ("cl-empty-value" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length:||"
     :then 400)
    ("cl-nbsp-before-digits" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: ^xa05||hello"
     :then 400)
    ("cl-19-digits" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 0000000000000000005||hello"
     :then 400)
    ("cl-huge" "9110 8.6"
     "POST / HTTP/1.1|Host: x|Content-Length: 99999999999999999999999||hello"
     :then 400)
    ("cl-over-limit-18-digits" "9110 15.5.14"
     "POST / HTTP/1.1|Host: x|Content-Length: 999999999999999999||hello"
     :then 413)
    ("cl-over-limit" "9110 15.5.14"
     "POST / HTTP/1.1|Host: x|Content-Length: 67108865||hello"
     :then 413)
    ("cl-obs-fold" "9112 5.2"
     "POST / HTTP/1.1|Host: x|Content-Length:| 5||hello"
     :then 400)
    ("cl-space-before-colon" "9112 5.1"
     "POST / HTTP/1.1|Host: x|Content-Length : 5||hello"
     :then 400)
    ;; A folded Transfer-Encoding: refused for the fold, whatever the
    ;; unfolded value would be.  (The classic "Transfer-Encoding:| chunked"
    ;; has a second fault, the empty value, and no policy for which wins.)
    ("te-obs-fold" "9112 5.2"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked|^tchunked||0||"
     :then 400)
    ("te-leading-space-before-name" "9112 5.2"
     "POST / HTTP/1.1|Host: x| Transfer-Encoding: chunked||0||"
     :then 400)
    ("te-space-before-colon" "9112 5.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding : chunked||0||"
     :then 400)
    ("te-tab-before-colon" "9112 5.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding^t: chunked||0||"
     :then 400)
    ("te-twice" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked|Transfer-Encoding: chunked||0||"
     :then 400)
    ("te-twice-chunked-then-identity" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked|Transfer-Encoding: identity||0||"
     :then 400)
    ("te-list-chunked-chunked" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked, chunked||0||"
     :then 501)
    ("te-list-gzip-chunked" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: gzip, chunked||0||"
     :then 501)
    ("te-list-chunked-identity" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked, identity||0||"
     :then 501)
    ("te-list-trailing-comma" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked,||0||"
     :then 501)
    ("te-identity" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: identity||"
     :then 501)
    ("te-gzip" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: gzip||"
     :then 501)
    ("te-xchunked" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: xchunked||0||"
     :then 501)
    ("te-chunked-suffix" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunkedx||0||"
     :then 501)
    ("te-quoted-chunked" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: \"chunked\"||0||"
     :then 501)
    ("te-chunked-with-parameter" "9112 7"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked;q=1||0||"
     :then 501)
    ("te-nbsp-before-chunked" "9112 6.1"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: ^xa0chunked||0||"
     :then 501)
    ("te-gzip-http10" "9112 6.1"
     "POST / HTTP/1.0|Transfer-Encoding: gzip||"
     :then 501)
    ("te-nul-after-chunked" "9110 5.5"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding: chunked^0||0||"
     :then 400)
    ("te-vertical-tab-before-chunked" "9110 5.5"
     "POST / HTTP/1.1|Host: x|Transfer-Encoding:^x0bchunked||0||"
     :then 400)

    ;;; -------------------------------------------------------------------
    ;;; Line ends: CRLF only (bare LF and bare CR are refused, RFC 9112 2.2)
    ;;; -------------------------------------------------------------------
    ("bare-lf-after-request-line" "9112 2.2"
     "GET / HTTP/1.1^nHost: x||"
     :then 400)
    ("bare-lf-after-header" "9112 2.2"
     "GET / HTTP/1.1|Host: x^nX-A: b||"
     :then 400)
    ("bare-lf-everywhere" "9112 2.2"
     "GET / HTTP/1.1^nHost: x^n^n"
     :then 400)
    ("bare-lf-ends-head" "9112 2.2"
     "GET / HTTP/1.1|Host: x|^n"
     :then 400)
    ("lf-cr-lf-ends-head" "9112 2.2"
     "GET / HTTP/1.1|Host: x^n^r^n"
     :then 400)
    ("bare-lf-empty-line-before-request" "9112 2.2"
     "^nGET / HTTP/1.1|Host: x||"
     :then 400)
    ("bare-lf-in-chunked-head" "9112 2.2"
     "POST / HTTP/1.1|Host: x^nTransfer-Encoding: chunked||0||"
     :then 400)
    ("bare-cr-after-request-line" "9112 2.2"
     "GET / HTTP/1.1^rHost: x||"
     :then 400)
    ("cr-cr-lf-after-request-line" "9112 2.2"
     "GET / HTTP/1.1^r|Host: x||"
     :then 400)
    ("bare-cr-after-header" "9112 2.2"
     "GET / HTTP/1.1|Host: x^rX-A: b||"
     :then 400)
    ("bare-cr-in-header-value" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: a^rb||"
     :then 400)
    ("bare-cr-in-target" "9112 3.2"
     "GET /a^rb HTTP/1.1|Host: x||"
     :then 400)

    ;;; -------------------------------------------------------------------
    ;;; Field syntax errors (RFC 9112 5, RFC 9110 5.5)
    ;;; -------------------------------------------------------------------
    ("field-space-before-colon" "9112 5.1"
     "GET / HTTP/1.1|Host : x||"
     :then 400)
    ("field-obs-fold-space" "9112 5.2"
     "GET / HTTP/1.1|Host: x|X-A: b|  c||"
     :then 400)
    ("field-obs-fold-tab" "9112 5.2"
     "GET / HTTP/1.1|Host: x|X-A: b|^tc||"
     :then 400)
    ("whitespace-line-after-request-line" "9112 2.2"
     "GET / HTTP/1.1| Host: x||"
     :then 400)
    ("field-empty-name" "9110 5.1"
     "GET / HTTP/1.1|Host: x|: v||"
     :then 400)
    ("field-without-colon" "9112 5"
     "GET / HTTP/1.1|Host: x|NoColonHere||"
     :then 400)
    ("field-name-with-space" "9110 5.1"
     "GET / HTTP/1.1|Host: x|X A: v||"
     :then 400)
    ("field-name-with-paren" "9110 5.1"
     "GET / HTTP/1.1|Host: x|X(A): v||"
     :then 400)
    ("field-name-with-slash" "9110 5.1"
     "GET / HTTP/1.1|Host: x|X/A: v||"
     :then 400)
    ("field-name-obs-text" "9110 5.1"
     "GET / HTTP/1.1|Host: x|X^xe9: v||"
     :then 400)
    ("field-name-nul" "9110 5.1"
     "GET / HTTP/1.1|Host: x|X^0A: v||"
     :then 400)
    ("field-value-nul" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: a^0b||"
     :then 400)
    ("field-value-soh" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: a^x01b||"
     :then 400)
    ("field-value-escape" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: a^x1bb||"
     :then 400)
    ("field-value-form-feed" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: a^x0cb||"
     :then 400)
    ("field-value-del" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: a^x7fb||"
     :then 400)
    ("field-value-nul-at-end" "9110 5.5"
     "GET / HTTP/1.1|Host: x|X-A: ab^0||"
     :then 400)
    ("host-missing-http11" "9112 3.2"
     "GET / HTTP/1.1|X-A: b||"
     :then 400)
    ("host-twice" "9112 3.2"
     "GET / HTTP/1.1|Host: a|Host: b||"
     :then 400)
    ("host-twice-same-value" "9112 3.2"
     "GET / HTTP/1.1|Host: a|Host: a||"
     :then 400)
    ("host-twice-different-case" "9112 3.2"
     "GET / HTTP/1.1|HOST: a|host: b||"
     :then 400)
    ("host-twice-http10" "9112 3.2"
     "GET / HTTP/1.0|Host: a|Host: b||"
     :then 400)
    ;; RFC 9112 3.2: 400 for a Host value that is not uri-host [ ":" port ]
    ("host-invalid-value" "9112 3.2"
     "GET / HTTP/1.1|Host: a b||"
     :then 400)
    ("host-with-a-path" "9112 3.2"
     "GET / HTTP/1.1|Host: a/b||"
     :then 400)
    ("host-with-userinfo" "9112 3.2"
     "GET / HTTP/1.1|Host: u@a||"
     :then 400)
    ("host-port-not-digits" "9112 3.2"
     "GET / HTTP/1.1|Host: a:80x||"
     :then 400)
    ("host-unclosed-ipv6-literal" "9112 3.2"
     "GET / HTTP/1.1|Host: [::1||"
     :then 400)
    ("host-bad-pct-encoding" "9112 3.2"
     "GET / HTTP/1.1|Host: a%zz||"
     :then 400)
    ("host-invalid-value-http10" "9112 3.2"
     "GET / HTTP/1.0|Host: a b||"
     :then 400)

    ;;; -------------------------------------------------------------------
    ;;; Request line errors (RFC 9112 3, 2.3)
    ;;; -------------------------------------------------------------------
    ("rl-two-spaces-after-method" "9112 3"
     "GET  / HTTP/1.1|Host: x||"
     :then 400)
    ("rl-two-spaces-before-version" "9112 3"
     "GET /  HTTP/1.1|Host: x||"
     :then 400)
    ("rl-trailing-space" "9112 3"
     "GET / HTTP/1.1 |Host: x||"
     :then 400)
    ("rl-tab-separator" "9112 3"
     "GET^t/ HTTP/1.1|Host: x||"
     :then 400)
    ("rl-leading-space" "9112 3"
     " GET / HTTP/1.1|Host: x||"
     :then 400)
    ("rl-no-version" "9112 3"
     "GET /|Host: x||"
     :then 400)
    ("rl-method-only" "9112 3"
     "GET|Host: x||"
     :then 400)
    ("rl-no-target" "9112 3"
     "GET HTTP/1.1|Host: x||"
     :then 400)
    ("rl-space-in-target" "9112 3.2"
     "GET /a b HTTP/1.1|Host: x||"
     :then 400)
    ("rl-method-non-token" "9110 9.1"
     "GE(T / HTTP/1.1|Host: x||"
     :then 400)
    ("rl-method-with-at" "9110 9.1"
     "G@T / HTTP/1.1|Host: x||"
     :then 400)
    ("rl-method-obs-text" "9110 9.1"
     "G^xc9T / HTTP/1.1|Host: x||"
     :then 400)
    ("target-soh" "9112 3.2"
     "GET /a^x01b HTTP/1.1|Host: x||"
     :then 400)
    ("target-nul" "9112 3.2"
     "GET /a^0b HTTP/1.1|Host: x||"
     :then 400)
    ("target-del" "9112 3.2"
     "GET /a^x7fb HTTP/1.1|Host: x||"
     :then 400)
    ("target-obs-text" "9112 3.2"
     "GET /caf^xe9 HTTP/1.1|Host: x||"
     :then 400)
    ("target-tab" "9112 3.2"
     "GET /a^tb HTTP/1.1|Host: x||"
     :then 400)
    ("target-bad-percent" "9112 3.2"
     "GET /a%zzb HTTP/1.1|Host: x||"
     :then 400)
    ("target-percent-one-digit-at-end" "9112 3.2"
     "GET /a%2 HTTP/1.1|Host: x||"
     :then 400)
    ("target-percent-percent" "9112 3.2"
     "GET /a%%20 HTTP/1.1|Host: x||"
     :then 400)
    ("target-percent-second-digit-not-hex" "9112 3.2"
     "GET /a%2G HTTP/1.1|Host: x||"
     :then 400)
    ("version-lower-case" "9112 2.3"
     "GET / http/1.1|Host: x||"
     :then 400)
    ("version-two-digit-minor" "9112 2.3"
     "GET / HTTP/1.10|Host: x||"
     :then 400)
    ("version-two-digit-major" "9112 2.3"
     "GET / HTTP/01.1|Host: x||"
     :then 400)
    ("version-no-minor" "9112 2.3"
     "GET / HTTP/1|Host: x||"
     :then 400)
    ("version-letter-minor" "9112 2.3"
     "GET / HTTP/1.a|Host: x||"
     :then 400)
    ("version-https" "9112 2.3"
     "GET / HTTPS/1.1|Host: x||"
     :then 400)
    ("version-2.0" "9110 15.6.6"
     "GET / HTTP/2.0|Host: x||"
     :then 505)
    ("version-1.2" "9110 15.6.6"
     "GET / HTTP/1.2|Host: x||"
     :then 505)
    ("version-0.9" "9110 15.6.6"
     "GET / HTTP/0.9|Host: x||"
     :then 505)
    ("version-3.0" "9110 15.6.6"
     "GET / HTTP/3.0|Host: x||"
     :then 505)
    ("version-9.9" "9110 15.6.6"
     "GET / HTTP/9.9|Host: x||"
     :then 505)
    ("http2-preface" "9110 15.6.6"
     "PRI * HTTP/2.0||SM||"
     :then 505)
    ("request-line-too-long" "9110 15.5.15"
     ("GET /" (:repeat "a" 70000) " HTTP/1.1|Host: x||")
     :then 414)
    ("head-too-large" "6585 5"
     ("GET / HTTP/1.1|Host: x|" (:numbered ("X-Big~D: " (:repeat "a" 60000) "|") 20) "|")
     :then 431)

    ;;; -------------------------------------------------------------------
    ;;; Chunk grammar errors (RFC 9112 7.1): 400 (413 past the body limit)
    ;;; -------------------------------------------------------------------
    ("chunk-size-trailing-space" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5 |hello|0||"
     :then 400)
    ("chunk-size-trailing-tab" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5^t|hello|0||"
     :then 400)
    ("chunk-size-leading-space" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked|| 5|hello|0||"
     :then 400)
    ("chunk-size-empty" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked|||hello|0||"
     :then 400)
    ("chunk-size-not-hex" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||g|hello|0||"
     :then 400)
    ("chunk-size-0x-prefix" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||0x5|hello|0||"
     :then 400)
    ("chunk-size-minus" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||-5|hello|0||"
     :then 400)
    ("chunk-size-plus" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||+5|hello|0||"
     :then 400)
    ("chunk-size-underscore" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5_0|hello|0||"
     :then 400)
    ;; 1*HEXDIG: leading zeros are digits like any other; only the value
    ;; (and the line's 1024 octets) is bounded.
    ("chunk-size-16-digits-leading-zeros" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||0000000000000005|hello|0||"
     :seen (("POST" "/c" 2 "hello")))
    ("chunk-size-overflow" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||10000000000000005|hello|0||"
     :then 400)
    ;; A chunk size past the body limit is refused once its line is read;
    ;; the few data bytes after it are all the client sends.
    ("chunk-size-15-digits-over-limit" "9110 15.5.14"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||fffffffffffffff|hello"
     :then 413)
    ("chunk-size-over-limit" "9110 15.5.14"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||4000001|hello"
     :then 413)
    ("chunks-total-over-limit" "9110 15.5.14"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|4000000|hello"
     :then 413)
    ("chunk-ext-empty-name" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;|hello|0||"
     :then 400)
    ("chunk-ext-bws-then-nothing" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5; |hello|0||"
     :then 400)
    ("chunk-ext-value-without-name" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;=v|hello|0||"
     :then 400)
    ("chunk-ext-empty-value" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=|hello|0||"
     :then 400)
    ("chunk-ext-double-semicolon" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;;a|hello|0||"
     :then 400)
    ("chunk-ext-unbalanced-quote" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=\"b|hello|0||"
     :then 400)
    ("chunk-ext-name-not-token" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a(b)|hello|0||"
     :then 400)
    ("chunk-ext-value-not-token" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=b@c|hello|0||"
     :then 400)
    ("chunk-ext-space-in-value" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=b c|hello|0||"
     :then 400)
    ("chunk-ext-trailing-space" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=b |hello|0||"
     :then 400)
    ("chunk-ext-control-in-quotes" "9110 5.6.4"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=\"b^x01\"|hello|0||"
     :then 400)
    ("chunk-ext-nul" "9112 7.1.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a^0|hello|0||"
     :then 400)
    ("chunk-ext-bare-cr" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a^rb|hello|0||"
     :then 400)
    ("chunk-ext-too-long" "9112 7.1.1"
     ("POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=" (:repeat "b" 1100) "|hello|0||")
     :then 400)
    ("chunk-data-longer-than-size" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||3|hello|0||"
     :then 400)
    ("chunk-data-shorter-than-size" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||7|hello|0||"
     :then 400)
    ("chunk-data-without-crlf" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello0||"
     :then 400)
    ("chunk-data-bare-lf" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello^n0||"
     :then 400)
    ("chunk-data-bare-cr" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello^r0||"
     :then 400)
    ("chunk-size-line-bare-lf" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5^nhello|0||"
     :then 400)
    ("last-chunk-bare-lf" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0^n|"
     :then 400)
    ("chunked-final-bare-lf" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|^n"
     :then 400)
    ("trailer-bare-lf" "9112 7.1.2"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: 1^n|"
     :then 400)
    ("trailer-bare-cr" "9112 7.1.2"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: 1^r||"
     :then 400)
    ("trailer-obs-fold" "9112 7.1.2"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: 1| 2||"
     :then 400)
    ("trailer-without-colon" "9112 7.1.2"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|garbage||"
     :then 400)
    ("trailer-space-before-colon" "9112 7.1.2"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T : 1||"
     :then 400)
    ("trailer-nul" "9112 7.1.2"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: a^0b||"
     :then 400)
    ("trailer-too-long" "9112 7.1.2"
     ("POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: " (:repeat "a" 1100) "||")
     :then 400)
    ;; A body error ends the connection: the request after it is never read.
    ("chunk-error-then-valid-request" "9112 7.1"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|helloXX|0||GET / HTTP/1.1|Host: x||"
     :then 400)

    ;;; -------------------------------------------------------------------
    ;;; Cut requests: the client stops sending and half-closes
    ;;; -------------------------------------------------------------------
    ("cut-nothing-sent" "9112 9.6"
     ""
     :then :close)
    ("cut-after-empty-line" "9112 2.2"
     "|"
     :then :close)
    ("cut-mid-method" "9112 8"
     "GE"
     :then :close)
    ("cut-mid-request-line" "9112 8"
     "GET / HT"
     :then :close)
    ("cut-end-of-request-line" "9112 8"
     "GET / HTTP/1.1|"
     :then :close)
    ("cut-mid-field-name" "9112 8"
     "GET / HTTP/1.1|Ho"
     :then :close)
    ("cut-mid-field-value" "9112 8"
     "GET / HTTP/1.1|Host: x"
     :then :close)
    ("cut-before-empty-line" "9112 8"
     "GET / HTTP/1.1|Host: x|"
     :then :close)
    ("cut-after-cr-of-empty-line" "9112 8"
     "GET / HTTP/1.1|Host: x|^r"
     :then :close)
    ;; The request line is whole and refused (bare LF): 400 whether the end
    ;; of file comes with it or after it.
    ("cut-bare-lf-head-unended" "9112 8"
     "GET / HTTP/1.1^nHost: x^n"
     :then 400)
    ("cut-before-body" "9112 8"
     "POST /p HTTP/1.1|Host: x|Content-Length: 5||"
     :then :close)
    ("cut-mid-body" "9112 8"
     "POST /p HTTP/1.1|Host: x|Content-Length: 10||hello"
     :then :close)
    ("cut-before-first-chunk" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||"
     :then :close)
    ("cut-mid-chunk-size" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||1"
     :then :close)
    ("cut-chunk-size-cr" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5^r"
     :then :close)
    ("cut-mid-chunk-ext-quote" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5;a=\"b"
     :then :close)
    ("cut-mid-chunk-data" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hel"
     :then :close)
    ("cut-after-chunk-data" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello"
     :then :close)
    ("cut-after-chunk" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|"
     :then :close)
    ("cut-after-last-chunk" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|"
     :then :close)
    ("cut-mid-trailer" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: 1"
     :then :close)
    ("cut-after-trailer" "9112 8"
     "POST /c HTTP/1.1|Host: x|Transfer-Encoding: chunked||5|hello|0|X-T: 1|"
     :then :close)
    ("cut-second-body" "9112 8"
     "POST /1 HTTP/1.1|Host: x|Content-Length: 5||helloPOST /2 HTTP/1.1|Host: x|Content-Length: 5||he"
     :seen (("POST" "/1" 2 "hello")) :then :close))
  "The conformance corpus: (NAME SECTION SEND &key SEEN THEN); see the top of
this file.")

;;; The notation

(defun unescape (string)
  "The octets STRING stands for, in the corpus notation (see the top of
this file)."
  (let ((out (make-array (length string) :element-type '(unsigned-byte 8)
                                         :adjustable t :fill-pointer 0))
        (i 0)
        (n (length string)))
    (flet ((emit (b) (vector-push-extend b out)))
      (loop while (< i n)
            do (let ((c (char string i)))
                 (incf i)
                 (cond ((char= c #\|) (emit 13) (emit 10))
                       ((char/= c #\^)
                        (assert (< (char-code c) 256) () "Not a Latin-1 character in ~S" string)
                        (emit (char-code c)))
                       (t
                        (assert (< i n) () "A lone ^ ends ~S" string)
                        (let ((e (char string i)))
                          (incf i)
                          (case e
                            (#\r (emit 13))
                            (#\n (emit 10))
                            (#\t (emit 9))
                            (#\0 (emit 0))
                            (#\| (emit (char-code #\|)))
                            (#\^ (emit (char-code #\^)))
                            (#\x (assert (<= (+ i 2) n) () "Short ^x in ~S" string)
                             (emit (parse-integer string :start i :end (+ i 2) :radix 16))
                             (incf i 2))
                            (t (error "Unknown escape ^~A in ~S" e string)))))))))
    (coerce out '(simple-array (unsigned-byte 8) (*)))))

(defun segment-octets (segment &optional index)
  "The octets of SEGMENT: an escaped string, (:repeat SEGMENT N),
(:numbered SEGMENT N) or a list of segments.  Inside :NUMBERED, INDEX is the
repetition's number and strings are FORMAT controls taking it."
  (flet ((join (parts)
           (let ((out (make-array (reduce #'+ parts :key #'length)
                                  :element-type '(unsigned-byte 8)))
                 (at 0))
             (dolist (part parts out)
               (replace out part :start1 at)
               (incf at (length part))))))
    (cond ((stringp segment) (unescape (if index (format nil segment index) segment)))
          ((eq (first segment) :repeat)
           (let ((one (segment-octets (second segment) index)))
             (join (loop repeat (third segment) collect one))))
          ((eq (first segment) :numbered)
           (join (loop for i from 1 to (third segment)
                       collect (segment-octets (second segment) i))))
          (t (join (mapcar (lambda (s) (segment-octets s index)) segment))))))

(defun segment-string (segment)
  "SEGMENT's octets as a Latin-1 string."
  (map 'string #'code-char (segment-octets segment)))

;;; Cases

(defstruct (conformance-case (:conc-name case-))
  name section octets seen then)

(defun parse-case (entry)
  (destructuring-bind (name section send &key seen then) entry
    (make-conformance-case
     :name name :section section :octets (segment-octets send)
     ;; each seen request as (METHOD TARGET HEADER-COUNT BODY-OCTETS)
     :seen (loop for (method target count body) in seen
                 collect (list (segment-string method) (segment-string target) count
                               (segment-octets body)))
     :then then)))

(defvar *cases* nil "The parsed corpus, made on first use.")

(defun corpus-cases ()
  "The corpus as CONFORMANCE-CASE structures."
  (or *cases* (setf *cases* (mapcar #'parse-case *corpus*))))

(defun expected-statuses (case)
  "The status of every answer CASE must get, in order (interim 1xx answers
are not counted)."
  (append (make-list (length (case-seen case)) :initial-element 200)
          (and (integerp (case-then case)) (list (case-then case)))))

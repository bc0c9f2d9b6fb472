;;;; parse-head.lisp -- GALLOP.CORE::PARSE-HEAD on byte vectors: no sockets,
;;;; milliseconds.  What an accepted head leaves in its REQUEST record (method,
;;;; version, target, the bounds of every field, Host, framing, Expect,
;;;; keep-alive), heads inside a larger buffer and records reused, and the
;;;; exact status of every refusal head.lisp's header lists.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: PARSE-HEAD and the REQUEST
;;;; record's fields (http/head.lisp, http/request.lisp): the parser is the
;;;; thing tested, on byte vectors.

(in-package #:gallop-tests)

(in-suite core)

;;; Helpers.  Heads are built from strings whose characters are octets; the
;;; record's bounds are read back as strings of the same octets.

(defun ph-octets (string)
  "STRING, each character an octet (code below 256), as octets."
  (coerce (map '(vector (unsigned-byte 8)) #'char-code string)
          '(simple-array (unsigned-byte 8) (*))))

(defun ph-head (&rest lines)
  "The request head of LINES, each ended by CRLF, then the empty line."
  (ph-octets (apply #'crlf lines)))

(defun ph-bytes (&rest parts)
  "Octets of PARTS: strings, octets, and :CR, :LF, :CRLF for line ends
written out (bare ones included)."
  (coerce (loop for p in parts
                append (etypecase p
                         (string (map 'list #'char-code p))
                         (integer (list p))
                         ((eql :cr) (list 13))
                         ((eql :lf) (list 10))
                         ((eql :crlf) (list 13 10))))
          '(simple-array (unsigned-byte 8) (*))))

(defun ph-parse (octets &key (start 0) end (request (gallop.core::make-request))
                             methods (max-body-bytes most-positive-fixnum))
  "PARSE-HEAD of OCTETS[START,END) (END: the end of OCTETS) into REQUEST (a
new record by default).  Returns its status and the record."
  (values (gallop.core::parse-head octets start (or end (length octets)) request
                                  :methods methods :max-body-bytes max-body-bytes)
          request))

(defun ph-string (buffer start end)
  (map 'string #'code-char (subseq buffer start end)))

(defun ph-target (buffer r)
  (ph-string buffer (gallop.core:request-target-start r) (gallop.core:request-target-end r)))

(defun ph-query (buffer r)
  "The target from its \"?\" on (\"\" when it has none)."
  (ph-string buffer (gallop.core:request-query-start r) (gallop.core:request-target-end r)))

(defun ph-host (buffer r)
  "The Host value by its bounds, or :NONE when they are -1."
  (let ((s (gallop.core::request-host-start r)) (e (gallop.core::request-host-end r)))
    (if (and (= s -1) (= e -1)) :none (ph-string buffer s e))))

(defun ph-fields (buffer r)
  "The header fields of R in order, as (name value) strings, through
DO-REQUEST-FIELDS."
  (let ((out '()))
    (gallop.core:do-request-fields (ns ne vs ve) r
      (push (list (ph-string buffer ns ne) (ph-string buffer vs ve)) out))
    (nreverse out)))

(defun ph-field-bounds (r)
  "The bounds of R's fields, through REQUEST-FIELD: a list of 4-lists."
  (loop for i below (gallop.core::request-field-count r)
        collect (multiple-value-list (gallop.core::request-field r i))))

(defun ph-invariants (buffer r)
  "NIL when R keeps the invariants of request.lisp's header over BUFFER,
else a description of the first one broken."
  (let ((start (gallop.core::request-start r)) (end (gallop.core::request-end r))
        (ts (gallop.core:request-target-start r)) (qs (gallop.core:request-query-start r))
        (te (gallop.core:request-target-end r)) (previous-end nil))
    (unless (and (<= start ts) (< ts qs) (<= qs te) (< te end))
      (return-from ph-invariants
        (format nil "start ~D target ~D query ~D target-end ~D end ~D" start ts qs te end)))
    (unless (if (= qs te)
                (not (find (char-code #\?) buffer :start ts :end te))
                (and (= (aref buffer qs) (char-code #\?))
                     (not (find (char-code #\?) buffer :start ts :end qs))))
      (return-from ph-invariants (format nil "query-start ~D is not the first ? or the end" qs)))
    (loop for (ns ne vs ve) in (ph-field-bounds r)
          do (unless (and (< (or previous-end start) ns) (< ns ne) (= (aref buffer ne) (char-code #\:))
                          (< ne vs) (<= vs ve) (< ve end)
                          (not (find (char-code #\:) buffer :start ns :end ne)))
               (return-from ph-invariants (format nil "field bounds ~D ~D ~D ~D" ns ne vs ve)))
             (when (< vs ve)
               (unless (and (not (member (aref buffer vs) '(32 9)))
                            (not (member (aref buffer (1- ve)) '(32 9))))
                 (return-from ph-invariants
                   (format nil "value ~S keeps white space" (ph-string buffer vs ve)))))
             (setf previous-end ve))
    nil))

(defmacro ph-accepts ((buffer request) form &body body)
  "Bind BUFFER to the octets of FORM, parse them into REQUEST, check it was
accepted with its invariants kept, then run BODY."
  (let ((status (gensym "STATUS")))
    `(let ((,buffer ,form))
       (multiple-value-bind (,status ,request) (ph-parse ,buffer)
         (declare (ignorable ,request))
         (is (null ,status) "refused (~S): ~S" ,status (ph-string ,buffer 0 (length ,buffer)))
         (is (null (ph-invariants ,buffer ,request)) "~A in ~S" (ph-invariants ,buffer ,request)
             (ph-string ,buffer 0 (length ,buffer)))
         ,@body))))


;;; Accepted heads: the record

(test parse-head-request-line
  (ph-accepts (b r) (ph-head "GET /path/to?x=1&y=%41 HTTP/1.1" "Host: example.com")
    (is (eq :get (gallop.core:request-method r)))
    (is (= 1 (gallop.core:request-minor r)))
    (is (= 0 (gallop.core::request-start r)))
    (is (= (length b) (gallop.core::request-end r)))
    (is (= 4 (gallop.core:request-target-start r)))
    (is (string= "/path/to?x=1&y=%41" (ph-target b r)))
    (is (= (+ 4 (length "/path/to")) (gallop.core:request-query-start r)))
    (is (string= "?x=1&y=%41" (ph-query b r))))
  ;; no query: QUERY-START is TARGET-END
  (ph-accepts (b r) (ph-head "GET /a/b.html HTTP/1.0")
    (is (= 0 (gallop.core:request-minor r)))
    (is (string= "/a/b.html" (ph-target b r)))
    (is (= (gallop.core:request-target-end r) (gallop.core:request-query-start r))))
  ;; the first "?" is the query's start; an empty query
  (ph-accepts (b r) (ph-head "GET /s?q=a?b HTTP/1.1" "Host: h")
    (is (string= "?q=a?b" (ph-query b r))))
  (ph-accepts (b r) (ph-head "GET /? HTTP/1.1" "Host: h")
    (is (string= "/?" (ph-target b r)))
    (is (= (1+ (gallop.core:request-target-start r)) (gallop.core:request-query-start r)))
    (is (= (1- (gallop.core:request-target-end r)) (gallop.core:request-query-start r))))
  ;; other target forms: asterisk, absolute, authority
  (ph-accepts (b r) (ph-head "OPTIONS * HTTP/1.1" "Host: h")
    (is (eq :options (gallop.core:request-method r)))
    (is (string= "*" (ph-target b r))))
  (ph-accepts (b r) (ph-head "GET http://h:8080/x?y HTTP/1.1" "Host: h:8080")
    (is (string= "http://h:8080/x?y" (ph-target b r)))
    (is (string= "?y" (ph-query b r))))
  (ph-accepts (b r) (ph-head "CONNECT h:443 HTTP/1.1" "Host: h:443")
    (is (eq :connect (gallop.core:request-method r)))
    (is (string= "h:443" (ph-target b r)))))

(test parse-head-common-methods
  (loop for (name keyword) in '(("GET" :get) ("HEAD" :head) ("POST" :post) ("PUT" :put)
                                ("DELETE" :delete) ("CONNECT" :connect) ("OPTIONS" :options)
                                ("TRACE" :trace) ("PATCH" :patch))
        do (multiple-value-bind (status r)
               (ph-parse (ph-head (format nil "~A /x HTTP/1.1" name) "Host: h"))
             (is (null status) "~A refused: ~S" name status)
             (is (eq keyword (gallop.core:request-method r))
                 "~A read as ~S" name (gallop.core:request-method r)))))

(test parse-head-method-case-is-exact
  ;; "get" is not GET: a method of its own, not a keyword.  (This file never
  ;; names that keyword, so nothing should have interned it.)
  (multiple-value-bind (status r) (ph-parse (ph-head "get / HTTP/1.1" "Host: h"))
    (is (null status))
    (let ((m (gallop.core:request-method r)))
      (is (not (eq :get m)))
      (is (symbolp m))
      (is (string= "get" (symbol-name m)))
      (is (null (symbol-package m)) "~S is interned in ~S" m (symbol-package m))))
  (multiple-value-bind (status r) (ph-parse (ph-head "Post / HTTP/1.1" "Host: h"))
    (is (null status))
    (is (not (eq :post (gallop.core:request-method r))))
    (is (string= "Post" (symbol-name (gallop.core:request-method r))))))

(test parse-head-named-methods
  ;; A method some code names (its keyword exists) comes back as that keyword.
  (multiple-value-bind (status r) (ph-parse (ph-head "PROPFIND /dav/ HTTP/1.1" "Host: h" "Depth: 1"))
    (is (null status))
    (is (eq :propfind (gallop.core:request-method r))))
  ;; A method no code names is an uninterned symbol of its name, a new one
  ;; each time, and the KEYWORD package does not grow; once its keyword
  ;; exists, that keyword.
  (let ((name (format nil "PHMETHOD~36R" (random (expt 36 10) (make-random-state t)))))
    (is (null (find-symbol name :keyword)))
    (flet ((method-of ()
             (multiple-value-bind (status r)
                 (ph-parse (ph-head (format nil "~A /x HTTP/1.1" name) "Host: h"))
               (is (null status))
               (gallop.core:request-method r))))
      (let ((m1 (method-of)) (m2 (method-of)))
        (is (string= name (symbol-name m1)))
        (is (null (symbol-package m1)))
        (is (not (eq m1 m2)))
        (is (null (find-symbol name :keyword)) "parsing interned ~A" name))
      (let ((keyword (intern name :keyword)))
        (unwind-protect
             (is (eq keyword (method-of)))
          (unintern keyword :keyword))))))

(test parse-head-fields
  (ph-accepts (b r) (ph-head "GET / HTTP/1.1"
                             "Host: example.com"
                             "X-Spaces:   a  b  "
                             (format nil "X-Tabs:~C~Cv~C" #\Tab #\Tab #\Tab)
                             "X-Empty:"
                             (format nil "X-Blank:  ~C " #\Tab)
                             "x-lower:v"
                             "X-Colons: a:b: c"
                             (format nil "X-Obs: caf~C" (code-char 233))
                             "Accept: */*")
    (is (= 9 (gallop.core::request-field-count r)))
    (is (equal `(("Host" "example.com")
                 ("X-Spaces" "a  b")
                 ("X-Tabs" "v")
                 ("X-Empty" "")
                 ("X-Blank" "")
                 ("x-lower" "v")
                 ("X-Colons" "a:b: c")
                 ("X-Obs" ,(format nil "caf~C" (code-char 233)))
                 ("Accept" "*/*"))
               (ph-fields b r))
        "fields: ~S" (ph-fields b r))
    ;; REQUEST-FIELD answers the same bounds as DO-REQUEST-FIELDS, in order
    (let ((walked '()))
      (gallop.core:do-request-fields (ns ne vs ve) r (push (list ns ne vs ve) walked))
      (is (equal (nreverse walked) (ph-field-bounds r))))
    ;; exact bounds of a few: name end at the colon, the empty value just
    ;; after it
    (let ((host-line (search (ph-octets "Host:") b))
          (empty-line (search (ph-octets "X-Empty:") b)))
      (is (equal (list host-line (+ host-line 4) (+ host-line 6) (+ host-line 6 (length "example.com")))
                 (first (ph-field-bounds r))))
      (destructuring-bind (ns ne vs ve) (fourth (ph-field-bounds r))
        (is (= empty-line ns))
        (is (= (+ empty-line 7) ne))
        (is (= vs ve (+ empty-line 8)))))
    (is (string= "example.com" (ph-host b r))))
  ;; no fields at all
  (ph-accepts (b r) (ph-head "GET / HTTP/1.0")
    (is (= 0 (gallop.core::request-field-count r)))
    (is (null (ph-fields b r)))))

(test parse-head-host
  (ph-accepts (b r) (ph-head "GET / HTTP/1.1" "Accept: */*" "Host:  example.com:8080 " "X: y")
    (is (string= "example.com:8080" (ph-host b r))))
  (ph-accepts (b r) (ph-head "GET / HTTP/1.1" "hOsT: h")
    (is (string= "h" (ph-host b r))))
  ;; HTTP/1.0: Host is optional; without it, -1 and -1
  (ph-accepts (b r) (ph-head "GET / HTTP/1.0" "Accept: */*")
    (is (eq :none (ph-host b r))))
  (ph-accepts (b r) (ph-head "GET / HTTP/1.0" "Host: old.example")
    (is (string= "old.example" (ph-host b r))))
  ;; an X-Host or Hostname is not Host
  (ph-accepts (b r) (ph-head "GET / HTTP/1.0" "X-Host: a" "Hostname: b")
    (is (eq :none (ph-host b r)))))

(test parse-head-body-framing
  (flet ((framing (&rest lines)
           (multiple-value-bind (status r) (ph-parse (apply #'ph-head lines))
             (list status (gallop.core:request-content-length r)
                   (gallop.core::request-body-length r) (gallop.core::request-chunked r)
                   (gallop.core::request-close-after r)))))
    ;;                    status CL  body-length chunked close-after
    (is (equal '(nil nil 0 nil nil) (framing "GET / HTTP/1.1" "Host: h")))
    (is (equal '(nil 0 0 nil nil) (framing "POST / HTTP/1.1" "Host: h" "Content-Length: 0")))
    (is (equal '(nil 42 42 nil nil) (framing "POST / HTTP/1.1" "Host: h" "Content-Length: 42")))
    (is (equal '(nil 42 42 nil nil) (framing "POST / HTTP/1.1" "Host: h" "content-LENGTH:  42 ")))
    (is (equal '(nil 7 7 nil nil) (framing "POST / HTTP/1.1" "Host: h" "Content-Length: 007")))
    ;; the same length twice is one length
    (is (equal '(nil 42 42 nil nil)
               (framing "POST / HTTP/1.1" "Content-Length: 42" "Host: h" "Content-Length: 42")))
    ;; 18 digits are read
    (is (equal '(nil 999999999999999999 999999999999999999 nil nil)
               (framing "POST / HTTP/1.1" "Host: h" "Content-Length: 999999999999999999")))
    (is (equal '(nil 5 5 nil nil) (framing "POST / HTTP/1.0" "Content-Length: 5")))
    ;; chunked: no length; in HTTP/1.0 the connection closes after it
    (is (equal '(nil nil 0 t nil) (framing "POST / HTTP/1.1" "Host: h" "Transfer-Encoding: chunked")))
    (is (equal '(nil nil 0 t nil) (framing "POST / HTTP/1.1" "Host: h" "transfer-encoding:  CHUNKED ")))
    (is (equal '(nil nil 0 t t) (framing "POST / HTTP/1.0" "Transfer-Encoding: chunked")))))

(test parse-head-expect-continue
  (flet ((expects (&rest fields)
           (multiple-value-bind (status r)
               (ph-parse (apply #'ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 3" fields))
             (is (null status) "~S refused: ~S" fields status)
             (gallop.core:request-expect-continue r))))
    (is-false (expects))
    (is-true (expects "Expect: 100-continue"))
    (is-true (expects "expect:100-CONTINUE"))
    (is-true (expects "EXPECT:  100-Continue  "))
    (is-true (expects "Expect: foo, 100-Continue"))
    (is-true (expects "Expect: 100-continue ,foo"))
    (is-true (expects "Expect: foo" "Expect: 100-continue"))
    (is-false (expects "Expect: foo"))
    (is-false (expects "Expect: 100-continuex"))
    (is-false (expects "Expect: 100"))
    (is-false (expects "Expect: foo100-continue"))
    (is-false (expects "Expect:"))
    (is-false (expects "X-Expect: 100-continue"))))

(test parse-head-keep-alive
  (flet ((keeps (version &rest fields)
           (multiple-value-bind (status r)
               (ph-parse (apply #'ph-head (format nil "GET / HTTP/~A" version) "Host: h" fields))
             (is (null status) "~A ~S refused: ~S" version fields status)
             (gallop.core:request-keep-alive r))))
    ;; HTTP/1.1: persistent unless "close"
    (is-true (keeps "1.1"))
    (is-true (keeps "1.1" "Connection: keep-alive"))
    (is-true (keeps "1.1" "Connection: upgrade"))
    (is-true (keeps "1.1" "Connection: closed"))
    (is-false (keeps "1.1" "Connection: close"))
    (is-false (keeps "1.1" "connection: CLOSE"))
    (is-false (keeps "1.1" "Connection: keep-alive, close"))
    (is-false (keeps "1.1" "Connection: upgrade,close ,x"))
    (is-false (keeps "1.1" "Connection: keep-alive" "Connection: close"))
    ;; HTTP/1.0: only with "keep-alive", and never with "close" too
    (is-false (keeps "1.0"))
    (is-false (keeps "1.0" "Connection: upgrade"))
    (is-true (keeps "1.0" "Connection: keep-alive"))
    (is-true (keeps "1.0" "Connection: Keep-Alive"))
    (is-true (keeps "1.0" "Connection: te, keep-alive"))
    (is-false (keeps "1.0" "Connection: keep-alive, close"))
    (is-false (keeps "1.0" "Connection: close" "Connection: keep-alive"))
    (is-false (keeps "1.0" "Connection: keep-alive" "Connection: close"))
    (is-false (keeps "1.0" "Keep-Alive: timeout=5"))))


;;; Heads inside a larger buffer, records reused

(test parse-head-inside-a-buffer
  ;; The head at a non-zero START, after an earlier request and before its
  ;; body and further input: every position is an index into the buffer,
  ;; the same as for the head alone shifted by START.
  (let* ((head (ph-head "POST /up?z=9 HTTP/1.1" "Host: new.example" "Content-Length: 5"
                        "X-A:  one " "Expect: 100-continue"))
         (before (ph-head "GET /old HTTP/1.1" "Host: old.example" "Content-Length: 77"))
         (after (ph-bytes "hello" :lf :cr "Host: x" :lf))
         (buffer (concatenate '(simple-array (unsigned-byte 8) (*)) before head after))
         (start (length before))
         (end (+ start (length head))))
    (multiple-value-bind (status r) (ph-parse buffer :start start :end end)
      (is (null status))
      (is (null (ph-invariants buffer r)) "~A" (ph-invariants buffer r))
      (is (= start (gallop.core::request-start r)))
      (is (= end (gallop.core::request-end r)))
      (is (eq :post (gallop.core:request-method r)))
      (is (string= "/up?z=9" (ph-target buffer r)))
      (is (string= "?z=9" (ph-query buffer r)))
      (is (string= "new.example" (ph-host buffer r)))
      (is (eql 5 (gallop.core:request-content-length r)))
      (is-true (gallop.core:request-expect-continue r))
      (is (equal '(("Host" "new.example") ("Content-Length" "5") ("X-A" "one")
                   ("Expect" "100-continue"))
                 (ph-fields buffer r)))
      (multiple-value-bind (status0 r0) (ph-parse head)
        (is (null status0))
        (flet ((positions (r offset)
                 (list* (- (gallop.core:request-target-start r) offset)
                        (- (gallop.core:request-query-start r) offset)
                        (- (gallop.core:request-target-end r) offset)
                        (- (gallop.core::request-host-start r) offset)
                        (- (gallop.core::request-host-end r) offset)
                        (loop for bounds in (ph-field-bounds r)
                              collect (mapcar (lambda (p) (- p offset)) bounds)))))
          (is (equal (positions r0 0) (positions r start))))))))

(test parse-head-reused-record
  ;; One record, heads one after the other: nothing of an earlier head stays.
  (let ((r (gallop.core::make-request)))
    (let ((b (apply #'ph-head "POST /first?q HTTP/1.1" "Host: one.example" "Content-Length: 10"
                    "Expect: 100-continue"
                    (loop for i below 40 collect (format nil "X-Field-~D: value ~D" i i)))))
      (is (null (ph-parse b :request r)))
      (is (= 43 (gallop.core::request-field-count r)))
      (is (eql 10 (gallop.core:request-content-length r)))
      (is-true (gallop.core:request-expect-continue r))
      (is-true (gallop.core:request-keep-alive r)))
    (let ((b (ph-head "GET / HTTP/1.0")))
      (is (null (ph-parse b :request r)))
      (is (null (ph-invariants b r)))
      (is (eq :get (gallop.core:request-method r)))
      (is (= 0 (gallop.core:request-minor r)))
      (is (= 0 (gallop.core::request-start r)))
      (is (= (length b) (gallop.core::request-end r)))
      (is (string= "/" (ph-target b r)))
      (is (string= "" (ph-query b r)))
      (is (= 0 (gallop.core::request-field-count r)))
      (is (null (ph-fields b r)))
      (is (eq :none (ph-host b r)))
      (is (null (gallop.core:request-content-length r)))
      (is (= 0 (gallop.core::request-body-length r)))
      (is-false (gallop.core::request-chunked r))
      (is-false (gallop.core:request-expect-continue r))
      (is-false (gallop.core:request-keep-alive r))
      (is-false (gallop.core::request-close-after r)))
    (let ((b (ph-head "PUT /c HTTP/1.0" "Transfer-Encoding: chunked" "Connection: keep-alive")))
      (is (null (ph-parse b :request r)))
      (is-true (gallop.core::request-chunked r))
      (is-true (gallop.core::request-close-after r))
      (is-true (gallop.core:request-keep-alive r)))
    (let ((b (ph-head "GET /d HTTP/1.1" "Host: two" "Connection: close")))
      (is (null (ph-parse b :request r)))
      (is (eq :get (gallop.core:request-method r)))
      (is (= 1 (gallop.core:request-minor r)))
      (is (equal '(("Host" "two") ("Connection" "close")) (ph-fields b r)))
      (is (string= "two" (ph-host b r)))
      (is-false (gallop.core::request-chunked r))
      (is-false (gallop.core::request-close-after r))
      (is-false (gallop.core:request-keep-alive r))
      (is (null (gallop.core:request-content-length r))))
    ;; after a refused head, an accepted one is read whole again
    (is (eql 400 (ph-parse (ph-head "GET / HTTP/1.1" "Host: a" "Host: b") :request r)))
    (let ((b (ph-head "GET /e HTTP/1.1" "Host: three")))
      (is (null (ph-parse b :request r)))
      (is (equal '(("Host" "three")) (ph-fields b r)))
      (is (string= "three" (ph-host b r)))
      (is-true (gallop.core:request-keep-alive r)))))

(test parse-head-field-index-grows
  ;; 100 fields: past the index's first room, every bound still right.
  (let* ((n 100)
         (b (apply #'ph-head "GET /many HTTP/1.1" "Host: h"
                   (loop for i from 1 below n collect (format nil "X-F~D:  v~D " i (* i i)))))
         (r (gallop.core::make-request)))
    (is (< gallop.core::+initial-fields+ n))
    (is (null (ph-parse b :request r)))
    (is (null (ph-invariants b r)) "~A" (ph-invariants b r))
    (is (= n (gallop.core::request-field-count r)))
    (is (<= (* 4 n) (length (gallop.core::request-fields r))))
    (is (equal (cons '("Host" "h") (loop for i from 1 below n
                                         collect (list (format nil "X-F~D" i) (format nil "v~D" (* i i)))))
               (ph-fields b r)))
    ;; and the bounds themselves, against where each line is
    (let ((line (search (ph-octets "X-F57:") b)))
      (is (equal (list line (+ line 5) (+ line 8) (+ line 8 (length "v3249")))
                 (multiple-value-list (gallop.core::request-field r 57)))))
    (is (string= "h" (ph-host b r)))))


;;; Refusals

(defparameter *parse-head-refusals*
  `(;; description                       status  head                 parse-head's keys
    ;; line ends
    ("bare LF after the request line" 400 ,(ph-bytes "GET / HTTP/1.1" :lf "Host: h" :crlf :crlf))
    ("bare LF after a field" 400 ,(ph-bytes "GET / HTTP/1.1" :crlf "Host: h" :lf "X: y" :crlf :crlf))
    ("bare LF as the empty line" 400 ,(ph-bytes "GET / HTTP/1.1" :crlf "Host: h" :crlf :lf))
    ("bare LF only" 400 ,(ph-bytes "GET / HTTP/1.0" :lf :lf))
    ("bare CR in the request line" 400 ,(ph-bytes "GET /a" :cr "b HTTP/1.1" :crlf "Host: h" :crlf :crlf))
    ("bare CR after the version" 400 ,(ph-bytes "GET / HTTP/1.1" :cr :crlf "Host: h" :crlf :crlf))
    ("bare CR in a value" 400 ,(ph-bytes "GET / HTTP/1.1" :crlf "Host: h" :crlf "X: a" :cr "b" :crlf :crlf))
    ("bare CR ending a value" 400 ,(ph-bytes "GET / HTTP/1.1" :crlf "Host: h" :cr :crlf :crlf))
    ("bare CR in a name" 400 ,(ph-bytes "GET / HTTP/1.1" :crlf "Host: h" :crlf "X" :cr "Y: b" :crlf :crlf))
    ("no empty line" 400 ,(ph-bytes "GET / HTTP/1.1" :crlf "Host: h" :crlf))
    ;; request line
    ("empty head" 400 ,(ph-bytes :crlf))
    ("no version" 400 ,(ph-head "GET /" "Host: h"))
    ("no target" 400 ,(ph-head "GET HTTP/1.1" "Host: h"))
    ("two spaces" 400 ,(ph-head "GET  / HTTP/1.1" "Host: h"))
    ("space after the version" 400 ,(ph-head "GET / HTTP/1.1 " "Host: h"))
    ("tab for a space" 400 ,(ph-head (format nil "GET~C/ HTTP/1.1" #\Tab) "Host: h"))
    ("method not a token" 400 ,(ph-head "GE(T / HTTP/1.1" "Host: h"))
    ("lower-case version" 400 ,(ph-head "GET / http/1.1" "Host: h"))
    ("version 1.1.1" 400 ,(ph-head "GET / HTTP/1.1.1" "Host: h"))
    ("version 10.1" 400 ,(ph-head "GET / HTTP/10.1" "Host: h"))
    ("target with a byte over 126" 400 ,(ph-head (format nil "GET /caf~C HTTP/1.1" (code-char 233)) "Host: h"))
    ("target with a control byte" 400 ,(ph-head (format nil "GET /a~Cb HTTP/1.1" (code-char 1)) "Host: h"))
    ("target with DEL" 400 ,(ph-head (format nil "GET /a~Cb HTTP/1.1" (code-char 127)) "Host: h"))
    ;; percent-encoding
    ("percent, no hex digits" 400 ,(ph-head "GET /a%zzb HTTP/1.1" "Host: h"))
    ("percent, one hex digit" 400 ,(ph-head "GET /a%4gb HTTP/1.1" "Host: h"))
    ("percent at the target's end" 400 ,(ph-head "GET /a% HTTP/1.1" "Host: h"))
    ("percent and one digit at the end" 400 ,(ph-head "GET /a%4 HTTP/1.1" "Host: h"))
    ("percent in the query" 400 ,(ph-head "GET /a?b=%%41 HTTP/1.1" "Host: h"))
    ;; versions
    ("HTTP/2.0" 505 ,(ph-head "GET / HTTP/2.0" "Host: h"))
    ("HTTP/1.2" 505 ,(ph-head "GET / HTTP/1.2" "Host: h"))
    ("HTTP/1.9" 505 ,(ph-head "GET / HTTP/1.9" "Host: h"))
    ("HTTP/0.9" 505 ,(ph-head "GET / HTTP/0.9" "Host: h"))
    ("HTTP/3.0" 505 ,(ph-head "GET / HTTP/3.0" "Host: h"))
    ;; field lines
    ("obs-fold with a space" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" "X-A: b" " continued"))
    ("obs-fold with a tab" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" "X-A: b" (format nil "~Ccontinued" #\Tab)))
    ("white space before the first field" 400 ,(ph-head "GET / HTTP/1.1" " Host: h"))
    ("space before the colon" 400 ,(ph-head "GET / HTTP/1.1" "Host : h"))
    ("tab before the colon" 400 ,(ph-head "GET / HTTP/1.1" (format nil "Host~C: h" #\Tab)))
    ("space before the colon, other field" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" "X-A : b"))
    ("no colon" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" "NoColonHere"))
    ("empty name" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" ": value"))
    ("name not a token" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" "X(A): b"))
    ("name with a byte over 126" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" (format nil "X-~C: b" (code-char 233))))
    ("NUL in a value" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" (format nil "X-A: a~Cb" (code-char 0))))
    ("BEL in a value" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" (format nil "X-A: a~Cb" (code-char 7))))
    ("ESC in a value" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" (format nil "X-A: ~C" (code-char 27))))
    ("DEL in a value" 400 ,(ph-head "GET / HTTP/1.1" "Host: h" (format nil "X-A: a~Cb" (code-char 127))))
    ("NUL in the Host value" 400 ,(ph-head "GET / HTTP/1.1" (format nil "Host: h~C" (code-char 0))))
    ;; Content-Length
    ("Content-Length negative" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: -5"))
    ("Content-Length with a plus" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: +5"))
    ("Content-Length not digits" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 12abc"))
    ("Content-Length hex" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 0x5"))
    ("Content-Length empty" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length:"))
    ("Content-Length blank" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length:   "))
    ("Content-Length a list" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 5, 5"))
    ("Content-Length with a space inside" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 1 2"))
    ("Content-Length of 19 digits" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 1000000000000000000"))
    ("Content-Length huge" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 99999999999999999999999"))
    ("two different Content-Lengths" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 5" "Content-Length: 6"))
    ("two Content-Lengths, case differs" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "content-length: 5" "CONTENT-LENGTH: 50"))
    ("second Content-Length bad" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 5" "Content-Length: x"))
    ;; Transfer-Encoding
    ("Content-Length and Transfer-Encoding" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 5" "Transfer-Encoding: chunked"))
    ("Transfer-Encoding and Content-Length" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Transfer-Encoding: chunked" "Content-Length: 5"))
    ("Content-Length and Transfer-Encoding, HTTP/1.0" 400 ,(ph-head "POST / HTTP/1.0" "Transfer-Encoding: chunked" "Content-Length: 5"))
    ("Transfer-Encoding twice" 400 ,(ph-head "POST / HTTP/1.1" "Host: h" "Transfer-Encoding: chunked" "Transfer-Encoding: chunked"))
    ("Transfer-Encoding gzip" 501 ,(ph-head "POST / HTTP/1.1" "Host: h" "Transfer-Encoding: gzip"))
    ("Transfer-Encoding identity" 501 ,(ph-head "POST / HTTP/1.1" "Host: h" "Transfer-Encoding: identity"))
    ("Transfer-Encoding gzip, chunked" 501 ,(ph-head "POST / HTTP/1.1" "Host: h" "Transfer-Encoding: gzip, chunked"))
    ("Transfer-Encoding chunked, chunked" 501 ,(ph-head "POST / HTTP/1.1" "Host: h" "Transfer-Encoding: chunked, chunked"))
    ("Transfer-Encoding empty" 501 ,(ph-head "POST / HTTP/1.1" "Host: h" "Transfer-Encoding:"))
    ;; Host
    ("two Hosts" 400 ,(ph-head "GET / HTTP/1.1" "Host: a" "Host: b"))
    ("two Hosts, the same" 400 ,(ph-head "GET / HTTP/1.1" "Host: a" "Host: a"))
    ("two Hosts, case differs" 400 ,(ph-head "GET / HTTP/1.1" "HOST: a" "host: b"))
    ("two Hosts in HTTP/1.0" 400 ,(ph-head "GET / HTTP/1.0" "Host: a" "Host: b"))
    ("HTTP/1.1 without Host" 400 ,(ph-head "GET / HTTP/1.1"))
    ("HTTP/1.1 with X-Host only" 400 ,(ph-head "GET / HTTP/1.1" "X-Host: a"))
    ;; limits
    ("Content-Length over the limit" 413 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 101")
     :max-body-bytes 100)
    ("Content-Length far over the limit" 413 ,(ph-head "POST / HTTP/1.0" "Content-Length: 999999999999999999")
     :max-body-bytes 100)
    ("a method not served" 501 ,(ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 0")
     :methods (:get :head))
    ("lower-case get, GET served" 501 ,(ph-head "get / HTTP/1.1" "Host: h") :methods (:get))
    ("a made-up method" 501 ,(ph-head "FROB / HTTP/1.1" "Host: h") :methods (:get)))
  "Heads PARSE-HEAD refuses: a description, the status, the octets, and
PARSE-HEAD's keys.")

(test parse-head-refusals
  (loop for (description status octets . keys) in *parse-head-refusals*
        do (let ((got (apply #'ph-parse octets keys)))
             (is (eql status got) "~A: expected ~S, got ~S for ~S"
                 description status got (ph-string octets 0 (length octets)))))
  ;; each refused the same inside a larger buffer, at a non-zero start
  (loop for (description status octets . keys) in *parse-head-refusals*
        do (let* ((before (ph-head "GET / HTTP/1.1" "Host: h"))
                  (buffer (concatenate '(simple-array (unsigned-byte 8) (*))
                                       before octets (ph-bytes :crlf :crlf)))
                  (got (apply #'ph-parse buffer :start (length before)
                              :end (+ (length before) (length octets)) keys)))
             (is (eql status got) "~A, at ~D: expected ~S, got ~S"
                 description (length before) status got))))

(test parse-head-limits-let-their-bound-pass
  ;; The other side of each refusal above: the limit itself is accepted.
  (multiple-value-bind (status r)
      (ph-parse (ph-head "POST / HTTP/1.1" "Host: h" "Content-Length: 100") :max-body-bytes 100)
    (is (null status))
    (is (eql 100 (gallop.core:request-content-length r))))
  ;; a chunked body has no declared length to hold against the limit
  (is (null (ph-parse (ph-head "POST / HTTP/1.1" "Host: h" "Transfer-Encoding: chunked")
                      :max-body-bytes 0)))
  (is (null (ph-parse (ph-head "GET / HTTP/1.1" "Host: h") :methods '(:get :head))))
  (is (null (ph-parse (ph-head "HEAD / HTTP/1.1" "Host: h") :methods '(:get :head))))
  (multiple-value-bind (status r)
      (ph-parse (ph-head "PROPFIND / HTTP/1.1" "Host: h") :methods '(:get :propfind))
    (is (null status))
    (is (eq :propfind (gallop.core:request-method r)))))

(test parse-head-field-count-limit
  ;; +MAX-HEADER-FIELDS+ fields (Host among them) pass; one more is 431.
  (let ((max gallop.core::+max-header-fields+))
    (flet ((head-of (n)
             (apply #'ph-head "GET / HTTP/1.1" "Host: h"
                    (loop for i from 1 below n collect (format nil "X-F~D: ~D" i i)))))
      (let ((b (head-of max)))
        (multiple-value-bind (status r) (ph-parse b)
          (is (null status))
          (is (= max (gallop.core::request-field-count r)))
          (is (equal (list (format nil "X-F~D" (1- max)) (format nil "~D" (1- max)))
                     (car (last (ph-fields b r)))))))
      (is (eql 431 (ph-parse (head-of (1+ max)))))
      (is (eql 431 (ph-parse (head-of (+ max 50))))))
    (is (= 1000 max))))

(test parse-head-ignores-100-continue-in-http/1.0
  ;; RFC 9110 10.1.1 and 15.2: no 1xx answer to an HTTP/1.0 client.
  (multiple-value-bind (status r)
      (ph-parse (ph-head "POST / HTTP/1.0" "Expect: 100-continue" "Content-Length: 3"))
    (is (null status))
    (is-false (gallop.core:request-expect-continue r))))

(test parse-head-checks-host-values
  ;; RFC 9112 3.2: 400 for a Host value that is not uri-host [ ":" port ].
  (dolist (host '("" "x" "example.com" "example.com:8080" "127.0.0.1:80" "[::1]" "[::1]:443"
                  "[v1.fe80::a+en1]" "ex%41mple" "a-b_c~d.e!$&'()*+,;=" "x:"))
    (is (null (ph-parse (ph-head "GET / HTTP/1.1" (format nil "Host: ~A" host))))
        "Host ~S refused" host))
  (dolist (host '("a b" "a/b" "u@a" "a:80x" "a:8:0" "[::1" "[]" "[::1]x" "a%zz" "a%4"
                  "a?b" "a#b" "a\"b" "[::1]:8a"))
    (is (eql 400 (ph-parse (ph-head "GET / HTTP/1.1" (format nil "Host: ~A" host))))
        "Host ~S accepted" host)))

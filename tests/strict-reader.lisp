;;;; strict-reader.lisp -- a strict client-side reader of HTTP/1.1 responses, for the
;;;; tests that must show a server's answer is a valid message byte by byte.
;;;;
;;;; READ-RESPONSE in util.lisp is lenient on purpose (it finds the status in
;;;; whatever comes).  This reader is not: it takes the raw octets as they come
;;;; over the socket and refuses anything RFC 9112 does not allow a server to
;;;; send, with a WIRE-ERROR that says what and where:
;;;;
;;;;   status-line  = "HTTP/1.1" SP 3DIGIT SP reason-phrase CRLF
;;;;   reason-phrase = *( HTAB / SP / VCHAR / obs-text )
;;;;   field-line   = token ":" OWS field-value OWS CRLF   (no CTL but HTAB in the value)
;;;;   then CRLF, then the body framed by exactly one of: no body (1xx, 204,
;;;;   304, an answer to HEAD), Content-Length (1*DIGIT, one field), chunked
;;;;   (RFC 9112 7.1, exactly), or the end of the connection.
;;;;
;;;; No bare CR or LF anywhere in the head or the chunk framing.  With :CLOSE,
;;;; the reader also waits (bounded) for the end of the connection and refuses
;;;; any byte after the message: that is how "Content-Length equal to the body
;;;; that follows" and "then the connection closes" are checked.  With
;;;; :PERSISTENT (a client that means to read more answers), a body delimited
;;;; by the end of the connection must be announced by Connection: close.
;;;; The sizes of the chunks and whether any chunk line carried an extension
;;;; are kept, for tests that check a server's own chunk framing.
;;;;
;;;; This is the tests' one strict reader: the body tests (native/bodies.lisp,
;;;; hunchentoot/bodies.lisp), the answers tests (core/answers.lisp) and the
;;;; conformance runner (conformance/runner.lisp) all read with it.
;;;;
;;;; The parser reads one byte at a time from a WIRE-SOURCE, so the same code
;;;; runs on an octet vector (the reader's own unit tests) and on a socket,
;;;; and never reads past the message it parses (an interim 100 leaves the
;;;; final answer unread).

(in-package #:gallop-tests)

(define-condition wire-error (error)
  ((message :initarg :message :reader wire-error-message)
   (position :initarg :position :reader wire-error-position))
  (:report (lambda (condition stream)
             (format stream "Invalid HTTP/1.1 response (byte ~D): ~A"
                     (wire-error-position condition) (wire-error-message condition))))
  (:documentation "The bytes read are not a valid HTTP/1.1 response (or the
connection did not end as it must)."))

(defstruct (wire-response (:conc-name wire-))
  "One response as read off the wire.  HEADERS are (NAME . VALUE) strings
(latin-1), in the order received, names as sent, values without the OWS
around them; HEAD is the exact octets of the status line and header section
including the empty line; CHUNK-SIZES are the sizes of the data chunks of a
chunked body, in order (the last, empty chunk not counted); FLAGS are
keywords: :INTERIM (1xx), :NO-BODY, :CONTENT-LENGTH, :CHUNKED,
:CLOSE-DELIMITED (the framing used, see WIRE-FRAMING), :CHUNK-EXTENSIONS (a
chunk line, the last included, carried an extension), :EOF (the connection
ended right after the message, checked with :CLOSE)."
  (status 0 :type fixnum)
  (reason "" :type string)
  (headers '() :type list)
  (trailers '() :type list)
  (chunk-sizes '() :type list)
  (body (make-array 0 :element-type '(unsigned-byte 8)) :type (vector (unsigned-byte 8)))
  (head (make-array 0 :element-type '(unsigned-byte 8)) :type (vector (unsigned-byte 8)))
  (flags '() :type list))

(defun wire-flag-p (response flag) (and (member flag (wire-flags response)) t))

(defun wire-framing (response)
  "How RESPONSE's body was delimited: :NO-BODY, :CONTENT-LENGTH, :CHUNKED or
:CLOSE-DELIMITED."
  (find-if (lambda (flag) (member flag '(:no-body :content-length :chunked :close-delimited)))
           (wire-flags response)))

(defun wire-header-values (response name)
  "The values of every field NAME (any case) of RESPONSE, in order."
  (loop for (n . v) in (wire-headers response)
        when (string-equal n name) collect v))

(defun wire-header (response name)
  "The value of the one field NAME (any case) of RESPONSE; NIL if absent.
Two or more fields of that name: a list of their values, as second value T."
  (let ((values (wire-header-values response name)))
    (if (cdr values) (values values t) (car values))))

(defun connection-option-p (value option)
  "True when the Connection field VALUE (a comma-separated list) names OPTION."
  (some (lambda (part) (string-equal (string-trim '(#\Space #\Tab) part) option))
        (uiop:split-string value :separator ",")))

(defun wire-body-string (response)
  (map 'string #'code-char (wire-body response)))

;;; Byte sources

(defconstant +wire-max-line+ 131072
  "The longest status or field line the reader accepts: a runaway answer must
not make a test hang or grow.  Twice the request line Gallop takes (65536
octets), which the conformance runner's app echoes in a field.")
(defconstant +wire-max-chunk-line+ 1024
  "The longest chunk size line the reader accepts: RFC 9112 sets no limit,
but a server's size line is a few hex digits, and Gallop refuses a request's
size or trailer line over 1024 bytes, so it must not send one.")
(defconstant +wire-max-fields+ 200)

(defstruct (wire-source (:constructor %make-wire-source (next)))
  "NEXT returns the next octet or NIL at end of input (it signals WIRE-ERROR
on a timeout or a reset).  POSITION counts the octets taken so far; MARK and
RECORD keep the octets of the head being read."
  (next nil :type function)
  (position 0 :type fixnum)
  (record nil))

(defun octet-source (octets &key (start 0))
  "A source reading OCTETS from START; its end is the end of the connection."
  (let ((i start) (end (length octets)))
    (%make-wire-source (lambda () (when (< i end) (prog1 (aref octets i) (incf i)))))))

(defun stream-source (stream &key (timeout 'sb-sys:io-timeout) (failure 'stream-error))
  "A source reading the binary STREAM (a socket stream with a timeout): a
condition of type TIMEOUT while reading is a WIRE-ERROR \"timed out\", one
of type FAILURE a WIRE-ERROR saying the connection failed."
  (let ((source nil))
    (setf source
          (%make-wire-source
           (lambda ()
             (handler-case (read-byte stream nil nil)
               (serious-condition (e)
                 (cond ((typep e timeout)
                        (wire-fail source "timed out waiting for more bytes"))
                       ((typep e failure)
                        (wire-fail source "the connection failed (~A)" e))
                       (t (error e))))))))
    source))

(defun wire-fail (source format-control &rest args)
  (error 'wire-error :position (wire-source-position source)
                     :message (apply #'format nil format-control args)))

(declaim (inline wire-next))
(defun wire-next (source)
  "The next octet of SOURCE, or NIL at the end."
  (let ((b (funcall (wire-source-next source))))
    (when b
      (incf (wire-source-position source))
      (let ((record (wire-source-record source)))
        (when record (vector-push-extend b record))))
    b))

;;; Character classes (RFC 9110 5.6.2, 5.5; RFC 5234)

(defun wire-tchar-p (b)
  (declare (type (unsigned-byte 8) b))
  (or (<= 48 b 57) (<= 65 b 90) (<= 97 b 122)
      (find b #.(map 'vector #'char-code "!#$%&'*+-.^_`|~"))))

(defun wire-vchar-p (b) (<= #x21 b #x7e))
(defun wire-obs-text-p (b) (<= #x80 b #xff))
(defun wire-ws-p (b) (or (= b 32) (= b 9)))
(defun wire-digit-p (b) (<= 48 b 57))
(defun wire-hexdig-p (b) (or (<= 48 b 57) (<= 65 b 70) (<= 97 b 102)))

(defun latin1 (octets &optional (start 0) (end (length octets)))
  (map 'string #'code-char (subseq octets start end)))

;;; Lines

(defun wire-read-line (source what &optional (limit +wire-max-line+))
  "Read one line ending in CRLF; return its octets without the CRLF.  A bare
CR or LF, the end of input, or a line over LIMIT octets is an error."
  (let ((line (make-array 64 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (loop
      (let ((b (wire-next source)))
        (cond ((null b) (wire-fail source "the connection ended inside the ~A" what))
              ((= b 13)
               (let ((next (wire-next source)))
                 (cond ((null next) (wire-fail source "the connection ended inside the ~A" what))
                       ((= next 10) (return line))
                       (t (wire-fail source "bare CR in the ~A" what)))))
              ((= b 10) (wire-fail source "bare LF (no CR before it) in the ~A" what))
              ((>= (length line) limit)
               (wire-fail source "the ~A is over ~D bytes" what limit))
              (t (vector-push-extend b line)))))))

(defun parse-status-line (source line)
  "STATUS and REASON of LINE, the octets of an HTTP/1.1 status line."
  (let ((n (length line)))
    (flet ((octet-at (i) (and (< i n) (aref line i))))
      (unless (and (>= n 8) (every #'= (octets "HTTP/1.1") (subseq line 0 8)))
        (wire-fail source "the status line does not start with HTTP/1.1: ~S" (latin1 line)))
      (unless (eql (octet-at 8) 32)
        (wire-fail source "no SP after the version: ~S" (latin1 line)))
      (unless (and (octet-at 11) (<= 49 (octet-at 9) 53)
                   (wire-digit-p (octet-at 10)) (wire-digit-p (octet-at 11)))
        (wire-fail source "the status code is not 3 digits from 100 to 599: ~S" (latin1 line)))
      (unless (eql (octet-at 12) 32)
        (wire-fail source "no SP after the status code: ~S" (latin1 line))))
    (loop for i from 13 below n
          for b = (aref line i)
          unless (or (wire-ws-p b) (wire-vchar-p b) (wire-obs-text-p b))
            do (wire-fail source "byte ~D (~D) is not allowed in the reason phrase" i b))
    (values (parse-integer (latin1 line 9 12)) (latin1 line 13))))

(defun parse-field-line (source line what)
  "(NAME . VALUE) of LINE, a field line (no CRLF)."
  (when (and (plusp (length line)) (wire-ws-p (aref line 0)))
    (wire-fail source "a ~A line starts with whitespace (obsolete folding): ~S" what (latin1 line)))
  (let ((colon (position 58 line)))
    (unless colon
      (wire-fail source "a ~A line has no colon: ~S" what (latin1 line)))
    (when (zerop colon)
      (wire-fail source "a ~A line has an empty name: ~S" what (latin1 line)))
    (loop for i below colon
          unless (wire-tchar-p (aref line i))
            do (wire-fail source "byte ~D (~D) of the ~A name ~S is not a token character"
                          i (aref line i) what (latin1 line 0 colon)))
    (let ((start (1+ colon)) (end (length line)))
      (loop while (and (< start end) (wire-ws-p (aref line start))) do (incf start))
      (loop while (and (> end start) (wire-ws-p (aref line (1- end)))) do (decf end))
      (loop for i from start below end
            for b = (aref line i)
            unless (or (wire-ws-p b) (wire-vchar-p b) (wire-obs-text-p b))
              do (wire-fail source "byte ~D (~D) is not allowed in the value of ~A ~S"
                            i b what (latin1 line 0 colon)))
      (cons (latin1 line 0 colon) (latin1 line start end)))))

(defun read-field-section (source what)
  "Field lines up to the empty line, in order."
  (loop for line = (wire-read-line source (format nil "~A section" what))
        for count from 0
        until (zerop (length line))
        when (>= count +wire-max-fields+)
          do (wire-fail source "more than ~D ~A fields" +wire-max-fields+ what)
        collect (parse-field-line source line what)))

;;; Bodies

(defun read-exactly (source count)
  (let ((body (make-array count :element-type '(unsigned-byte 8))))
    (dotimes (i count body)
      (let ((b (wire-next source)))
        (unless b
          (wire-fail source "the connection ended after ~D of ~D body bytes" i count))
        (setf (aref body i) b)))))

(defun read-until-end (source)
  (let ((body (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (loop for b = (wire-next source) while b do (vector-push-extend b body))
    (coerce body '(simple-array (unsigned-byte 8) (*)))))

(defun parse-chunk-line (source line)
  "The size of the chunk whose size line (without CRLF) is LINE:
chunk-size [ chunk-ext ], chunk-ext = *( BWS \";\" BWS name [ BWS \"=\" BWS
( token / quoted-string ) ] ).  Second value: true when LINE has an extension."
  (let ((n (length line)) (i 0))
    (flet ((bad (why) (wire-fail source "chunk line ~S: ~A" (latin1 line) why))
           (skip-ws () (loop while (and (< i n) (wire-ws-p (aref line i))) do (incf i)))
           (token () (let ((start i))
                       (loop while (and (< i n) (wire-tchar-p (aref line i))) do (incf i))
                       (> i start))))
      (loop while (and (< i n) (wire-hexdig-p (aref line i))) do (incf i))
      (cond ((zerop i) (bad "no hexadecimal size"))
            ((> i 15) (bad "a size of more than 15 digits")))
      (let ((size (parse-integer (latin1 line 0 i) :radix 16))
            (hex-end i))
        (loop
          ;; BWS only ever comes before a ";" (or an "=" inside an extension).
          (let ((ws-start i))
            (skip-ws)
            (when (= i n)
              (if (> i ws-start)
                  (bad "whitespace with no extension after it")
                  (return (values size (> n hex-end))))))
          (unless (= (aref line i) 59) (bad "junk where an extension or CRLF must be"))
          (incf i)
          (skip-ws)
          (unless (token) (bad "an extension with an empty name"))
          (let ((before i))
            (skip-ws)
            (cond ((and (< i n) (= (aref line i) 61))
                   (incf i)
                   (skip-ws)
                   (cond ((and (< i n) (= (aref line i) 34))
                          ;; quoted-string = DQUOTE *( qdtext / quoted-pair ) DQUOTE
                          (incf i)
                          (loop
                            (when (>= i n) (bad "an unterminated quoted string"))
                            (let ((b (aref line i)))
                              (cond ((= b 34) (incf i) (return))
                                    ((= b 92)
                                     (incf i)
                                     (unless (and (< i n)
                                                  (let ((q (aref line i)))
                                                    (or (wire-ws-p q) (wire-vchar-p q)
                                                        (wire-obs-text-p q))))
                                       (bad "a bad quoted pair"))
                                     (incf i))
                                    ((or (wire-ws-p b) (= b 33) (<= #x23 b #x5b)
                                         (<= #x5d b #x7e) (wire-obs-text-p b))
                                     (incf i))
                                    (t (bad "a bad byte in a quoted string"))))))
                         ((not (token)) (bad "an extension with an empty value"))))
                  (t (setf i before)))))))))

(defun read-chunked (source)
  "The decoded body, the trailer fields, the sizes of the data chunks, and
whether any chunk line had an extension, of a chunked body (RFC 9112 7.1)."
  (let ((body (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0))
        (sizes '())
        (extended nil))
    (loop
      (multiple-value-bind (size extension)
          (parse-chunk-line source (wire-read-line source "chunk size line" +wire-max-chunk-line+))
        (when extension (setf extended t))
        (when (zerop size)
          (return))
        (push size sizes)
        (loop for b across (read-exactly source size) do (vector-push-extend b body))
        (let ((cr (wire-next source)) (lf (wire-next source)))
          (unless (and (eql cr 13) (eql lf 10))
            (wire-fail source "chunk data not followed by CRLF (~S ~S)" cr lf)))))
    (values (coerce body '(simple-array (unsigned-byte 8) (*)))
            (read-field-section source "trailer")
            (nreverse sizes)
            extended)))

;;; Messages

(defun read-wire-message (source &key head-request persistent)
  "Read one response from SOURCE (HEAD-REQUEST: it answers a HEAD, so it has
no body).  PERSISTENT: the client means to read more answers on the
connection, so a body delimited by its end must be announced by Connection:
close (else the reader would wait for an end that may never come).  Returns a
WIRE-RESPONSE; signals WIRE-ERROR if it is not a valid HTTP/1.1 response."
  (let ((record (make-array 256 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (setf (wire-source-record source) record)
    (multiple-value-bind (status reason)
        (parse-status-line source (wire-read-line source "status line"))
      (let* ((headers (read-field-section source "header"))
             (response (make-wire-response :status status :reason reason :headers headers
                                           :head (coerce record '(simple-array (unsigned-byte 8) (*))))))
        (setf (wire-source-record source) nil)
        (flet ((all (name) (loop for (n . v) in headers when (string-equal n name) collect v))
               (flag (f) (push f (wire-flags response))))
          (let ((lengths (all "Content-Length"))
                (codings (all "Transfer-Encoding")))
            (when (and lengths codings)
              (wire-fail source "both Content-Length and Transfer-Encoding"))
            (when (cdr lengths)
              (wire-fail source "Content-Length sent ~D times" (length lengths)))
            (when (cdr codings)
              (wire-fail source "Transfer-Encoding sent ~D times" (length codings)))
            (when (and lengths (not (and (plusp (length (first lengths)))
                                         (<= (length (first lengths)) 18)
                                         (every #'digit-char-p (first lengths)))))
              (wire-fail source "Content-Length is not 1*DIGIT: ~S" (first lengths)))
            (when (and codings (not (string-equal (first codings) "chunked")))
              (wire-fail source "a transfer coding other than chunked: ~S" (first codings)))
            (when (< status 200)
              (flag :interim))
            (cond ((or (< status 200) (= status 204) (= status 304) head-request)
                   ;; RFC 9112 6.3: no body, whatever the fields say.
                   (when (and (or (< status 200) (= status 204)) (or lengths codings))
                     (wire-fail source "a ~D answer with Content-Length or Transfer-Encoding" status))
                   (flag :no-body))
                  (codings
                   (multiple-value-bind (body trailers sizes extended) (read-chunked source)
                     (setf (wire-body response) body
                           (wire-trailers response) trailers
                           (wire-chunk-sizes response) sizes)
                     (when extended (flag :chunk-extensions)))
                   (flag :chunked))
                  (lengths
                   (setf (wire-body response) (read-exactly source (parse-integer (first lengths))))
                   (flag :content-length))
                  (t
                   (when (and persistent
                              (notany (lambda (v) (connection-option-p v "close"))
                                      (all "Connection")))
                     (wire-fail source "a body delimited by the end of the connection, ~
                                        with no Connection: close"))
                   (setf (wire-body response) (read-until-end source))
                   (flag :close-delimited)))))
        response))))

(defun expect-end (source response)
  "Check that nothing follows RESPONSE on SOURCE; flag it :EOF."
  (let ((extra (loop for b = (wire-next source) while b collect b into bytes
                     when (>= (length bytes) 64) return bytes
                     finally (return bytes))))
    (when extra
      (wire-fail source "~:[~;at least ~]~D byte~:P after the message: ~S"
                 (>= (length extra) 64) (length extra) (map 'string #'code-char extra)))
    (push :eof (wire-flags response))
    response))

(defun parse-wire (octets &key (start 0) head-request close persistent)
  "Parse one response from OCTETS at START; the end of OCTETS is the end of
the connection.  With CLOSE, OCTETS must end right after it.  Returns the
WIRE-RESPONSE and the position after it."
  (let* ((source (octet-source octets :start start))
         (response (read-wire-message source :head-request head-request
                                             :persistent persistent)))
    (when close (expect-end source response))
    (values response (+ start (wire-source-position source)))))

(defun read-wire (socket &key head-request close persistent (eof-timeout 5))
  "Read one response from SOCKET, strictly (HEAD-REQUEST and PERSISTENT as
for READ-WIRE-MESSAGE).  With CLOSE, the connection must then end (within
EOF-TIMEOUT seconds) with no further byte.  Signals WIRE-ERROR otherwise."
  (let ((response (read-wire-message (stream-source (usocket:socket-stream socket))
                                     :head-request head-request :persistent persistent)))
    (if close
        (read-wire-end socket response :eof-timeout eof-timeout)
        response)))

(defun read-wire-end (socket response &key (eof-timeout 5))
  "Check that the connection SOCKET ends (within EOF-TIMEOUT seconds) with no
byte after RESPONSE, just read from it; flag RESPONSE :EOF.  Signals
WIRE-ERROR otherwise."
  (let* ((stream (usocket:socket-stream socket))
         (source (stream-source stream))
         (saved (sb-impl::fd-stream-timeout stream)))
    (setf (sb-impl::fd-stream-timeout stream) (float eof-timeout 1.0))
    (unwind-protect
         (handler-case (expect-end source response)
           (wire-error (e)
             (if (search "timed out" (wire-error-message e))
                 (wire-fail source "the connection was still open ~D s after the message"
                            eof-timeout)
                 (error e))))
      (setf (sb-impl::fd-stream-timeout stream) saved))))

(defun read-wire-or-error (socket &rest options)
  "READ-WIRE, but a WIRE-ERROR is returned instead of signalled (for IS)."
  (handler-case (apply #'read-wire socket options)
    (wire-error (e) e)))

;;; The reader's own tests: valid messages and each malformation, on bytes.

(defun exact-answer-p (response body)
  "RESPONSE is a 200 whose Content-Length names exactly BODY, which follows."
  (and (wire-response-p response)
       (= 200 (wire-status response))
       (eq :content-length (wire-framing response))
       (equal (princ-to-string (length body)) (wire-header response "Content-Length"))
       (string= body (wire-body-string response))))

(def-suite wire :in gallop :description "The strict HTTP/1.1 response reader of the tests.")
(in-suite wire)

(defun wire-octets (&rest parts)
  "PARTS (strings, or octet codes) as one octet vector."
  (let ((out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (dolist (p parts (coerce out '(simple-array (unsigned-byte 8) (*))))
      (etypecase p
        (string (loop for c across p do (vector-push-extend (char-code c) out)))
        (integer (vector-push-extend p out))))))

(defun wire-text (string)
  "STRING with every | replaced by CRLF."
  (with-output-to-string (s)
    (loop for c across string
          do (if (char= c #\|) (format s "~C~C" #\Return #\Linefeed) (write-char c s)))))

(defun parses (string &rest options)
  (apply #'parse-wire (octets (wire-text string)) options))

(defun refused (octets &rest options)
  "The WIRE-ERROR parsing OCTETS signals, or NIL if it parses."
  (handler-case (progn (apply #'parse-wire octets options) nil)
    (wire-error (e) e)))

(test wire-reads-valid-messages
  ;; Content-Length, fields in order, OWS trimmed, the head kept exactly.
  (multiple-value-bind (r end)
      (parses "HTTP/1.1 200 OK|Content-Type: text/plain|X-A:  a b	|Content-Length: 5||hello" :close t)
    (is (= 200 (wire-status r)))
    (is (string= "OK" (wire-reason r)))
    (is (equal '(("Content-Type" . "text/plain") ("X-A" . "a b") ("Content-Length" . "5"))
               (wire-headers r)))
    (is (string= "hello" (wire-body-string r)))
    (is (equalp (octets (wire-text "HTTP/1.1 200 OK|Content-Type: text/plain|X-A:  a b	|Content-Length: 5||"))
                (wire-head r)))
    (is (wire-flag-p r :content-length))
    (is (wire-flag-p r :eof))
    (is (= end (length (wire-text "HTTP/1.1 200 OK|Content-Type: text/plain|X-A:  a b	|Content-Length: 5||hello")))))
  ;; An empty reason, obs-text in the reason and in a value, an empty value.
  (let ((r (parse-wire (wire-octets (wire-text "HTTP/1.1 404 |X-E:|X-O: ") #xe9 (wire-text "|Content-Length: 0||")))))
    (is (string= "" (wire-reason r)))
    (is (equal `(("X-E" . "") ("X-O" . ,(string (code-char #xe9))) ("Content-Length" . "0"))
               (wire-headers r))))
  (is (string= (format nil "Caf~C	ok" (code-char #xe9))
               (wire-reason (parse-wire (wire-octets "HTTP/1.1 200 Caf" #xe9 (wire-text "	ok|Content-Length: 0||"))))))
  ;; A body holding CR and LF is just octets, in either framing.
  (let ((r (parse-wire (wire-octets (wire-text "HTTP/1.1 200 OK|Content-Length: 3||") "a" 10 "b") :close t)))
    (is (equalp (wire-octets "a" 10 "b") (wire-body r)))
    (is (eq :content-length (wire-framing r))))
  ;; Chunked, with extensions (BWS, token and quoted values) and trailers.
  (let ((r (parses "HTTP/1.1 200 OK|Transfer-Encoding: Chunked||5 ; a = b ;c;d=\"x\\\"y z\"|hello|A|0123456789|000|T: v||"
                   :close t)))
    (is (string= "hello0123456789" (wire-body-string r)))
    (is (equal '(("T" . "v")) (wire-trailers r)))
    (is (wire-flag-p r :chunked))
    (is (eq :chunked (wire-framing r))))
  ;; 1xx, 204 and an answer to HEAD have no body: the next message follows.
  (multiple-value-bind (r end) (parses "HTTP/1.1 100 Continue||HTTP/1.1 200 OK|Content-Length: 2||ok")
    (is (= 100 (wire-status r)))
    (is (wire-flag-p r :interim))
    (is (= 25 end))
    (let ((final (parse-wire (octets (wire-text "HTTP/1.1 100 Continue||HTTP/1.1 200 OK|Content-Length: 2||ok"))
                             :start end :close t)))
      (is (= 200 (wire-status final)))
      (is (string= "ok" (wire-body-string final)))))
  (is (wire-flag-p (parses "HTTP/1.1 204 No Content|X: y||" :close t) :no-body))
  (is (zerop (length (wire-body (parses "HTTP/1.1 200 OK|Content-Length: 9||" :head-request t :close t)))))
  ;; No framing field: the body runs to the end of the connection.
  (let ((r (parses "HTTP/1.1 200 OK||all of it")))
    (is (wire-flag-p r :close-delimited))
    (is (string= "all of it" (wire-body-string r))))
  ;; Two messages back to back without :CLOSE: the first ends where it should.
  (is (= 39 (nth-value 1 (parses "HTTP/1.1 200 OK|Content-Length: 1||aHTTP/1.1 200 OK|Content-Length: 1||b")))))

(defparameter *wire-malformations*
  `(("no HTTP/1.1" "does not start with HTTP/1.1" "HTTP/1.0 200 OK|Content-Length: 0||")
    ("lower-case version" "does not start with HTTP/1.1" "http/1.1 200 OK|Content-Length: 0||")
    ("two spaces after the version" "not 3 digits" "HTTP/1.1  200 OK|Content-Length: 0||")
    ("two-digit status" "not 3 digits" "HTTP/1.1 20 OK|Content-Length: 0||")
    ("four-digit status" "no SP after the status code" "HTTP/1.1 2000 OK|Content-Length: 0||")
    ("status 600" "not 3 digits" "HTTP/1.1 600 Odd|Content-Length: 0||")
    ("no SP after the status" "no SP after the status code" "HTTP/1.1 200|Content-Length: 0||")
    ("CTL in the reason" "reason phrase" ,(wire-octets "HTTP/1.1 200 O" 1 (wire-text "K|Content-Length: 0||")))
    ("DEL in the reason" "reason phrase" ,(wire-octets "HTTP/1.1 200 O" 127 (wire-text "K|Content-Length: 0||")))
    ("bare LF after the status line" "bare LF" ,(wire-octets "HTTP/1.1 200 OK" 10 (wire-text "Content-Length: 0||")))
    ("bare CR in the status line" "bare CR" ,(wire-octets "HTTP/1.1 200 O" 13 (wire-text "K|Content-Length: 0||")))
    ("bare LF ending a field" "bare LF" ,(wire-octets (wire-text "HTTP/1.1 200 OK|") "Content-Length: 0" 10 (wire-text "|")))
    ("bare CR ending a field" "bare CR" ,(wire-octets (wire-text "HTTP/1.1 200 OK|") "Content-Length: 0" 13 (wire-text "X: y||")))
    ("bare LF ending the head" "bare LF" ,(wire-octets (wire-text "HTTP/1.1 200 OK|Content-Length: 0|") 10))
    ("bare CR in a value" "bare CR" ,(wire-octets (wire-text "HTTP/1.1 200 OK|X: a") 13 (wire-text "b|Content-Length: 0||")))
    ("NUL in a value" "not allowed in the value" ,(wire-octets (wire-text "HTTP/1.1 200 OK|X: a") 0 (wire-text "b|Content-Length: 0||")))
    ("DEL in a value" "not allowed in the value" ,(wire-octets (wire-text "HTTP/1.1 200 OK|X: a") 127 (wire-text "b|Content-Length: 0||")))
    ("space before the colon" "not a token character" "HTTP/1.1 200 OK|Content-Length : 0||")
    ("no colon" "no colon" "HTTP/1.1 200 OK|Content-Length 0||")
    ("empty field name" "empty name" "HTTP/1.1 200 OK|: x|Content-Length: 0||")
    ("non-token name" "not a token character" "HTTP/1.1 200 OK|X(y): z|Content-Length: 0||")
    ("obsolete line folding" "obsolete folding" "HTTP/1.1 200 OK|X: a| b|Content-Length: 0||")
    ("head cut off" "ended inside the header section" "HTTP/1.1 200 OK|Content-Length: 0|")
    ("nothing at all" "ended inside the status line" "")
    ("body shorter than Content-Length" "after 1 of 16 body bytes" "HTTP/1.1 200 OK|Content-Length: 16||a")
    ("body longer than Content-Length" "after the message" "HTTP/1.1 200 OK|Content-Length: 1||ab")
    ("Content-Length twice" "Content-Length sent 2 times" "HTTP/1.1 200 OK|Content-Length: 1|Content-Length: 1||a")
    ("Content-Length list" "not 1*DIGIT" "HTTP/1.1 200 OK|Content-Length: 1, 1||a")
    ("signed Content-Length" "not 1*DIGIT" "HTTP/1.1 200 OK|Content-Length: +1||a")
    ("empty Content-Length" "not 1*DIGIT" "HTTP/1.1 200 OK|Content-Length: ||")
    ("Content-Length and Transfer-Encoding" "both Content-Length and Transfer-Encoding" "HTTP/1.1 200 OK|Content-Length: 1|Transfer-Encoding: chunked||1|a|0||")
    ("gzip coding" "other than chunked" "HTTP/1.1 200 OK|Transfer-Encoding: gzip||")
    ("Transfer-Encoding twice" "Transfer-Encoding sent 2 times" "HTTP/1.1 200 OK|Transfer-Encoding: chunked|Transfer-Encoding: chunked||0||")
    ("100 with Content-Length" "a 100 answer with Content-Length" "HTTP/1.1 100 Continue|Content-Length: 0||")
    ("chunk size not hex" "no hexadecimal size" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||g|x|0||")
    ("chunk size with a sign" "no hexadecimal size" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||+1|x|0||")
    ("chunk size over 15 digits" "more than 15 digits" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||0000000000000001|x|0||")
    ("chunk size line over 1024 bytes" "chunk size line is over 1024 bytes"
     ,(format nil "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1;~A|x|0||" (make-string 1023 :initial-element #\a)))
    ("whitespace after the size, no extension" "whitespace with no extension" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1 |x|0||")
    ("empty extension name" "empty name" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1;|x|0||")
    ("unbalanced quote" "unterminated quoted string" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1;a=\"b|x|0||")
    ("empty extension value" "empty value" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1;a=|x|0||")
    ("bare LF after the chunk size" "bare LF" ,(wire-octets (wire-text "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1") 10 (wire-text "x|0||")))
    ("chunk data longer than its size" "not followed by CRLF" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1|xy|0||")
    ("chunk data ended by LF" "not followed by CRLF" ,(wire-octets (wire-text "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1|x") 10 (wire-text "0||")))
    ("no last chunk" "ended inside the chunk size line" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1|x|")
    ("no CRLF after the last chunk" "ended inside the trailer section" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||0|")
    ("bad trailer" "trailer line has no colon" "HTTP/1.1 200 OK|Transfer-Encoding: chunked||0|T v||")
    ("bytes after a closing message" "1 byte after the message" "HTTP/1.1 200 OK|Content-Length: 0||x"))
  "Name, what the refusal must say, and the bytes (| stands for CRLF in a
string) of responses the reader must refuse; read with :CLOSE, so bytes
after the message count too.")

(test wire-records-chunk-framing
  ;; The sizes of the data chunks in order, and whether any chunk line (the
  ;; last included) carried an extension: a server's own framing is checked
  ;; with them.
  (let ((r (parse-wire (wire-octets (wire-text "HTTP/1.1 200 OK|Transfer-Encoding: chunked||2|ab|1|")
                                    13 (wire-text "|00|T: x||"))
                       :close t)))
    (is (equalp (wire-octets "ab" 13) (wire-body r)))
    (is (equal '(2 1) (wire-chunk-sizes r)))
    (is (not (wire-flag-p r :chunk-extensions))))
  (let ((r (parses "HTTP/1.1 200 OK|Transfer-Encoding: chunked||2;x=y|ab|0||" :close t)))
    (is (equal '(2) (wire-chunk-sizes r)))
    (is (wire-flag-p r :chunk-extensions)))
  (is (wire-flag-p (parses "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1|a|0;end||") :chunk-extensions))
  (is (null (wire-chunk-sizes (parses "HTTP/1.1 200 OK|Transfer-Encoding: chunked||0||"))))
  ;; A size line of exactly +WIRE-MAX-CHUNK-LINE+ octets is still read.
  (is (equal '(1) (wire-chunk-sizes
                   (parses (format nil "HTTP/1.1 200 OK|Transfer-Encoding: chunked||1;~A|x|0||"
                                   (make-string 1022 :initial-element #\a)))))))

(test wire-refuses-an-unannounced-close-when-persistent
  ;; With :PERSISTENT, a body delimited by the end of the connection needs
  ;; Connection: close (a list naming it will do); without, it is read.
  (let ((refusal (refused (octets (wire-text "HTTP/1.1 200 OK|X: y||abc")) :persistent t)))
    (is (and refusal (search "no Connection: close" (wire-error-message refusal)))))
  (is (refused (octets (wire-text "HTTP/1.1 200 OK|Connection: keep-alive||abc")) :persistent t))
  (is (string= "abc" (wire-body-string (parses "HTTP/1.1 200 OK|Connection: close||abc" :persistent t))))
  (is (string= "abc" (wire-body-string (parses "HTTP/1.1 200 OK|Connection: x, Close||abc" :persistent t))))
  (is (string= "abc" (wire-body-string (parses "HTTP/1.1 200 OK|X: y||abc"))))
  ;; framed answers need no Connection: close
  (is (string= "abc" (wire-body-string (parses "HTTP/1.1 200 OK|Content-Length: 3||abc" :persistent t)))))

(test wire-refuses-each-malformation
  (loop for (name why bytes) in *wire-malformations*
        for octets = (if (stringp bytes) (octets (wire-text bytes)) bytes)
        for refusal = (refused octets :close t)
        do (is (and refusal (search why (wire-error-message refusal)))
               "~A: ~:[accepted~;~:*refused with ~S~]" name
               (and refusal (wire-error-message refusal)))))

(test wire-reads-a-socket-and-checks-its-end
  ;; A server that writes given bytes and then closes, or keeps the
  ;; connection open: READ-WIRE sees exactly what PARSE-WIRE sees.
  (flet ((serve (bytes &key keep-open)
           (let* ((listener (usocket:socket-listen "127.0.0.1" 0 :reuse-address t
                                                                 :element-type '(unsigned-byte 8)))
                  (port (usocket:get-local-port listener))
                  (thread (sb-thread:make-thread
                           (lambda ()
                             (let ((s (usocket:socket-accept listener)))
                               (write-sequence (octets (wire-text bytes)) (usocket:socket-stream s))
                               (force-output (usocket:socket-stream s))
                               ;; Open until the client has given up and closed.
                               (when keep-open
                                 (handler-case (read-byte (usocket:socket-stream s) nil nil)
                                   (error () nil)))
                               (usocket:socket-close s))))))
             (let ((socket (connect port)))
               ;; The end of file must come within 3 s, or the wire reader
               ;; says "still open": long enough for a preempted server
               ;; thread, short for the branch that waits it out.
               (unwind-protect (read-wire-or-error socket :close t :eof-timeout 3)
                 (usocket:socket-close socket)
                 (sb-thread:join-thread thread)
                 (usocket:socket-close listener))))))
    (let ((r (serve "HTTP/1.1 200 OK|Content-Length: 2||ok")))
      (is (wire-response-p r))
      (is (and (wire-response-p r) (wire-flag-p r :eof))))
    (let ((e (serve "HTTP/1.1 200 OK|Content-Length: 2||okEXTRA")))
      (is (and (typep e 'wire-error) (search "after the message" (wire-error-message e)))))
    (let ((e (serve "HTTP/1.1 200 OK|Content-Length: 2||ok" :keep-open t)))
      (is (and (typep e 'wire-error) (search "still open" (wire-error-message e)))))
    (let ((e (serve "HTTP/1.1 200 OK|Content-Length: 16||a")))
      (is (and (typep e 'wire-error) (search "after 1 of 16 body bytes" (wire-error-message e)))))))

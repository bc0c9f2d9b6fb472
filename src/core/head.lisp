;;;; head.lisp -- checking a complete HTTP/1.x request head before any handler
;;;; sees it.
;;;;
;;;; The engine calls CHECK-HEAD once the end of a head is buffered (see
;;;; SCAN-HEAD), so a head split at any byte is checked exactly like one that
;;;; arrived at once.  It walks the octets in place (no strings, no
;;;; allocation but for a method no code names) and answers the HTTP status
;;;; that refuses the request, or NIL:
;;;;   400  malformed request line; a line not ended by CRLF (bare LF; a bare
;;;;        CR fails the byte checks of its line); a header line without a
;;;;        colon or with white space before it; obsolete line folding; NUL or
;;;;        control bytes; invalid percent-encoding in the target; a
;;;;        Content-Length that is not 1*DIGIT or differs from another;
;;;;        Transfer-Encoding together with Content-Length, or twice (request
;;;;        smuggling); two Host fields, or an HTTP/1.1 request without one
;;;;   413  Content-Length over the body limit (before the body is read)
;;;;   501  a transfer coding other than chunked
;;;;   505  an HTTP version other than 1.0 and 1.1
;;;; Any method token passes.  It records the body's framing in the
;;;; connection's BODY-LENGTH and CHUNKED, whether the client expects 100
;;;; Continue in EXPECT-CONTINUE, and in CLOSE-AFTER that the connection must
;;;; close after the answer (chunked framing in HTTP/1.0, RFC 9112 6.1).

(in-package #:gallop.core)

(declaim (inline tchar-p vchar-p digit-value hex-value))

(deftype octet-set () '(simple-bit-vector 256))

(defun make-octet-set (predicate)
  (let ((set (make-array 256 :element-type 'bit :initial-element 0)))
    (dotimes (b 256 set)
      (when (funcall predicate b) (setf (sbit set b) 1)))))

(defparameter +tchars+
  (make-octet-set (lambda (b)
                    (or (<= 97 b 122) (<= 65 b 90) (<= 48 b 57)
                        (member b '(33 35 36 37 38 39 42 43 45 46 94 95 96 124 126)))))
  "The token characters (RFC 9110, 5.6.2), as a bit per octet: one memory
read per octet instead of a chain of comparisons.")

(defun tchar-p (b)
  "A token character (RFC 9110, 5.6.2)."
  (declare (type (unsigned-byte 8) b))
  (= 1 (sbit (the octet-set (load-time-value +tchars+ t)) b)))

(defun vchar-p (b)
  "A byte allowed in a field value: visible ASCII, obs-text, space or tab."
  (declare (type (unsigned-byte 8) b))
  (or (<= 32 b 126) (= b 9) (>= b 128)))

(defun digit-value (b)
  (declare (type (unsigned-byte 8) b))
  (and (<= 48 b 57) (- b 48)))

(defun hex-value (b)
  (declare (type (unsigned-byte 8) b))
  (cond ((<= 48 b 57) (- b 48))
        ((<= 97 b 102) (- b 87))
        ((<= 65 b 70) (- b 55))))

;;; Methods.  Any token is a method (RFC 9110, 9.1): the common ones are
;;; matched against literals (OCTETS-CASE, no table read per request) and
;;; answer their keyword; any other is looked up by name.
(macrolet ((define-known-method (&rest names)
             `(defun known-method (buffer start end)
                "The keyword of the common method in BUFFER[START,END), or NIL."
                (declare (type octets buffer) (type fixnum start end) (optimize speed))
                (octets-case (buffer start end)
                  ,@(loop for name in names
                          collect `(,name ,(intern name :keyword)))
                  (t nil)))))
  (define-known-method
   "GET" "HEAD" "POST" "PUT" "DELETE" "CONNECT" "OPTIONS" "TRACE" "PATCH"))

(defun method-symbol (buffer start end)
  "The method token BUFFER[START,END) as a symbol: the keyword of that exact
name when it is a common method or such a keyword already exists (an
application that handles a method names its keyword), else an uninterned
symbol of that name, so that clients sending made-up methods cannot grow the
KEYWORD package."
  (declare (type octets buffer) (type fixnum start end))
  (or (known-method buffer start end)
      (let ((name (map 'simple-string #'code-char (subseq buffer start end))))
        (multiple-value-bind (symbol status) (find-symbol name :keyword)
          (if status symbol (make-symbol name))))))

(defun field-bounds (buffer start end)
  "START and END of BUFFER[START,END) without the CR before END, and without
surrounding spaces and tabs: the bounds of a header field's value."
  (declare (type octets buffer) (type fixnum start end))
  (when (and (> end start) (= (aref buffer (1- end)) +cr+)) (decf end))
  (loop while (and (< start end) (let ((b (aref buffer start))) (or (= b 32) (= b 9))))
        do (incf start))
  (loop while (and (< start end) (let ((b (aref buffer (1- end)))) (or (= b 32) (= b 9))))
        do (decf end))
  (values start end))

(defun check-request-line (buffer start end)
  "Check the request line BUFFER[START,END) (END at its LF, which a CR must
precede).  Returns the status that refuses it or NIL, the HTTP minor version
\(0 or 1), and the method's symbol."
  (declare (type octets buffer) (type fixnum start end) (optimize speed))
  (unless (and (> end start) (= (aref buffer (1- end)) +cr+))
    (return-from check-request-line 400))
  (let ((line-end (1- end))
        (i start))
    (declare (type fixnum line-end i))
    ;; method: a token
    (loop while (and (< i line-end) (tchar-p (aref buffer i))) do (incf i))
    (when (or (= i start) (>= i line-end) (/= (aref buffer i) +sp+))
      (return-from check-request-line 400))
    (let ((method-end i))
      (incf i)
      ;; request target: visible ASCII, valid percent-encoding
      (let ((target-start i))
        (loop while (< i line-end)
              do (let ((b (aref buffer i)))
                   (cond ((= b +sp+) (return))
                         ((not (<= 33 b 126)) (return-from check-request-line 400))
                         ((= b +percent+)
                          (unless (and (< (+ i 2) line-end)
                                       (hex-value (aref buffer (+ i 1)))
                                       (hex-value (aref buffer (+ i 2))))
                            (return-from check-request-line 400))))
                   (incf i)))
        (when (or (= i target-start) (>= i line-end))
          (return-from check-request-line 400)))
      (incf i)
      ;; HTTP-version = "HTTP/" DIGIT "." DIGIT
      (unless (and (= (- line-end i) 8)
                   (octets-match-p buffer i (+ i 5) "HTTP/")
                   (digit-value (aref buffer (+ i 5)))
                   (= (aref buffer (+ i 6)) 46) (digit-value (aref buffer (+ i 7))))
        (return-from check-request-line 400))
      (let ((major (- (aref buffer (+ i 5)) 48))
            (minor (- (aref buffer (+ i 7)) 48)))
        (if (and (= major 1) (<= minor 1))
            (values nil minor (method-symbol buffer start method-end))
            (values 505 0))))))

(defun parse-content-length (buffer start end)
  "The value of a Content-Length field, or NIL if it is not 1*DIGIT."
  (declare (type octets buffer) (type fixnum start end))
  (when (and (< start end) (<= (- end start) 18))
    (let ((n 0))
      (declare (type (integer 0 999999999999999999) n))
      (loop for i of-type fixnum from start below end
            do (let ((d (digit-value (aref buffer i))))
                 (unless d (return-from parse-content-length nil))
                 (setf n (+ (* n 10) d))))
      n)))

(defun check-head (c)
  "Check the complete request head buffered in connection C.  Returns the
status that refuses it, or NIL."
  (with-connection-slots (inbuf in-start scan engine body-length chunked expect-continue
                          request-method close-after) c
    (let* ((buffer inbuf)
           (head-end scan)
           (line-end (line-end buffer in-start head-end))
           (content-length nil)
           (transfer-encoding nil)
           (hosts 0))
      (declare (type octets buffer) (type fixnum head-end hosts)
               (type (or null (integer 0 999999999999999999)) content-length)
               (optimize speed))
      (setf body-length 0 chunked nil expect-continue nil close-after nil)
      (multiple-value-bind (status minor method) (check-request-line buffer in-start line-end)
        (declare (type (or null fixnum) minor))
        (when status (return-from check-head status))
        (setf request-method method)
        (let ((methods (engine-methods engine)))
          ;; A layer above that serves only some methods: refuse the others
          ;; here, with a well-formed answer, rather than let it answer them
          ;; its own way (Hunchentoot 1.3.x: an HTTP/1.0 400).
          (when (and methods (not (member method methods :test #'eq)))
            (return-from check-head 501)))
        ;; Header fields, each ending in CRLF, up to the empty line.  A bare
        ;; LF anywhere is refused here, and a bare CR fails the byte checks
        ;; of the line it is in: there is one reading of the line ends.
        (loop with start of-type fixnum = (1+ line-end)
              for end = (line-end buffer start head-end)
              do (unless (and end (> end start) (= (aref buffer (1- end)) +cr+))
                   (return-from check-head 400))
                 (when (= end (1+ start))
                   (return))            ; the empty line
                 (let ((b (aref buffer start)))
                   (when (or (= b +sp+) (= b +tab+)) ; obsolete line folding
                     (return-from check-head 400))
                   (let ((colon (octet-position +colon+ buffer start end)))
                     (unless (and colon (> colon start)
                                  (loop for i of-type fixnum from start below colon
                                        always (tchar-p (aref buffer i))))
                       (return-from check-head 400))
                     (multiple-value-bind (vs ve) (field-bounds buffer (1+ colon) end)
                       (unless (loop for i of-type fixnum from vs below ve
                                     always (vchar-p (aref buffer i)))
                         (return-from check-head 400))
                       (octets-case (buffer start colon :ignore-case t)
                         ("content-length"
                          (let ((n (parse-content-length buffer vs ve)))
                            (when (or (null n) (and content-length (/= n content-length)))
                              (return-from check-head 400))
                            (setf content-length n)))
                         ("transfer-encoding"
                          ;; Only "chunked", alone, is implemented (as nginx).
                          (when transfer-encoding
                            (return-from check-head 400))
                          (unless (octets-match-p buffer vs ve "chunked" :ignore-case t)
                            (return-from check-head 501))
                          (setf transfer-encoding t))
                         ("host"
                          (incf hosts))
                         ("expect"
                          (setf expect-continue
                                (octets-match-p buffer vs ve "100-continue" :ignore-case t))))))
                   (setf start (1+ end))))
        (cond ((and transfer-encoding content-length) 400)
              ((> hosts 1) 400)
              ((and (= minor 1) (/= hosts 1)) 400)
              ((and content-length (> content-length (engine-max-body-bytes engine))) 413)
              (t (setf body-length (or content-length 0)
                       chunked (and transfer-encoding t)
                       ;; RFC 9112, 6.1: chunked framing in HTTP/1.0 is read,
                       ;; answered, and the connection closed after it.
                       close-after (and transfer-encoding (= minor 0)))
                 nil))))))
